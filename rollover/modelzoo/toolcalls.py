"""Tool-call transcripts made locally, and the short warm-up that teaches a bundled model
to call functions the way vLLM's `hermes` parser reads them.

A framework agent (the OpenAI Agents SDK, AutoGen) sends its tools with every request and
only sees a tool call when the model writes `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`. SmolLM2-135M-Instruct was never taught that format and the tiny model knows no
format at all, so a few dozen steps on transcripts like these come first: each shows one to
three tools, a request one of them answers, the call, the tool's result and a short answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A function the transcripts call: its schema, requests for it and how it answers."""

    name: str
    description: str
    parameters: dict[str, str]  # argument name -> JSON type ("number" or "string")
    # rng -> (user request, arguments, tool result, final answer)
    make: Callable[[random.Random], tuple[str, dict[str, Any], str, str]]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {name: {"type": kind} for name, kind in self.parameters.items()},
                    "required": list(self.parameters),
                },
            },
        }


def _arithmetic(symbol: str, word: str, fn: Callable[[int, int], int]):
    def make(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        request = rng.choice(
            [f"What is {a} {symbol} {b}?", f"Please {word} {a} and {b}.", f"Compute {a} {symbol} {b}."]
        )
        return request, {"a": a, "b": b}, str(fn(a, b)), f"The result is {fn(a, b)}."

    return make


def _calculate(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    expression = f"({a} + {b}) * {c}"
    value = (a + b) * c
    return f"Use the calculator: what is {expression}?", {"expression": expression}, str(value), f"It is {value}."


_CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth", "Seoul", "Dakar"]


def _weather(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
    city, temperature = rng.choice(_CITIES), rng.randint(-5, 35)
    sky = rng.choice(["sunny", "cloudy", "rainy", "windy"])
    result = json.dumps({"city": city, "temperature_c": temperature, "sky": sky})
    return f"How is the weather in {city}?", {"city": city}, result, f"It is {temperature} C and {sky} in {city}."


def _word_length(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
    word = rng.choice(["river", "lantern", "orbit", "meadow", "quartz", "harbor", "pixel", "saddle"])
    return (
        f"How many letters are in the word {word}?",
        {"word": word},
        str(len(word)),
        f"The word {word} has {len(word)} letters.",
    )


DEFAULT_TOOLS = (
    ToolSpec("add", "Add two numbers.", {"a": "number", "b": "number"}, _arithmetic("+", "add", lambda a, b: a + b)),
    ToolSpec(
        "subtract",
        "Subtract b from a.",
        {"a": "number", "b": "number"},
        _arithmetic("-", "subtract", lambda a, b: a - b),
    ),
    ToolSpec(
        "multiply",
        "Multiply two numbers.",
        {"a": "number", "b": "number"},
        _arithmetic("*", "multiply", lambda a, b: a * b),
    ),
    ToolSpec("calculate", "Evaluate an arithmetic expression.", {"expression": "string"}, _calculate),
    ToolSpec("get_weather", "The current weather in a city.", {"city": "string"}, _weather),
    ToolSpec("word_length", "The number of letters in a word.", {"word": "string"}, _word_length),
)


def tool_call_transcripts(
    count: int, *, seed: int = 0, tools: Sequence[ToolSpec] = DEFAULT_TOOLS, system: str | None = None
) -> list[dict[str, Any]]:
    """`count` chats `{"messages", "tools"}` in OpenAI's format (assistant `tool_calls`,
    `tool` results), each offering one to three of `tools` and calling one of them."""
    rng = random.Random(seed)
    chats = []
    for index in range(count):
        target = rng.choice(list(tools))
        others = [t for t in tools if t is not target]
        shown = [target, *rng.sample(others, k=min(len(others), rng.randint(0, 2)))]
        rng.shuffle(shown)
        request, arguments, result, answer = target.make(rng)
        call_id = f"call_{index}"
        messages: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
        messages += [
            {"role": "user", "content": request},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": target.name, "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result},
            {"role": "assistant", "content": answer},
        ]
        chats.append({"messages": messages, "tools": [t.schema() for t in shown]})
    return chats


def warm_up_tool_calls(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    steps: int = 60,
    lr: float = 5e-5,
    transcripts: Sequence[dict[str, Any]] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """A short supervised warm-up on tool-call transcripts (default: 2000 of the above)."""
    from rollover.modelzoo.warmup import sft_warmup

    chats = list(transcripts) if transcripts is not None else tool_call_transcripts(2000, seed=seed)
    return sft_warmup(model_dir, chats, out_dir, steps=steps, lr=lr, batch_size=16, seed=seed, num_threads=1)
