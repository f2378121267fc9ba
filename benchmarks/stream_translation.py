"""What a streamed token costs the gateway on each route, in-process: the chat route's work (the
assembler parses each of the engine's chunks and gathers the answer to record) and, on the
translated routes, the translator's on top (each chunk made into one of its API's events, built
and encoded). Calls of two lengths, interleaved; the per-token figure is the slope between them,
the per-call one what is left.

    .venv/bin/python benchmarks/stream_translation.py [--short 8] [--long 64] [--rounds 30]

The issue's bar: translation adds no per-token work beyond the chat route's but the event it
must write. The engine's chunks are shaped as vLLM streams them (token ids and a logprob each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollover.gateway.apis.anthropic import AnthropicStream, AnthropicTranslation
from rollover.gateway.apis.responses import ResponsesStream, ResponsesTranslation, parse_request
from rollover.gateway.streaming import StreamAssembler, StreamTranslator


def engine_stream(tokens: int) -> list[bytes]:
    """A chat stream of `tokens` one-token chunks, as vLLM sends it to the gateway."""
    chunks = []
    for i in range(tokens):
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f" word{i}"},
                    "logprobs": {"content": [{"token": f"token_id:{100 + i}", "logprob": -0.5, "bytes": [32]}]},
                    "finish_reason": "length" if i == tokens - 1 else None,
                    "token_ids": [100 + i],
                }
            ],
        }
        if i == 0:
            chunk["prompt_token_ids"] = list(range(30))
        chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return [*chunks, b"data: [DONE]\n\n"]


def _anthropic() -> StreamTranslator:
    body = {"model": "policy", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    return AnthropicStream(AnthropicTranslation(body))


def _responses() -> StreamTranslator:
    body = {"model": "policy", "input": "hi", "stream": True}
    return ResponsesStream(ResponsesTranslation(parse_request(body), body, []))


# route -> the translator its calls start (None: the chat route relays the engine's bytes)
ROUTES: dict[str, Callable[[], StreamTranslator] | None] = {
    "chat completions": None,
    "anthropic messages": _anthropic,
    "responses": _responses,
}


def relay(stream: list[bytes], translator: Callable[[], StreamTranslator] | None) -> bytes:
    """One streamed call's gateway work: every chunk fed to the assembler (and the translator),
    the events taken as the relay takes them, the answer put together. What goes to the agent."""
    events = None if translator is None else translator()
    assembler = StreamAssembler("chat/completions", None, None if events is None else events.chunk)
    written: list[bytes] = []
    for piece in stream:
        assembler.feed(piece)
        written.append(piece if events is None else events.take())
    answer = assembler.response()
    if events is not None:
        written.append(events.end(answer))
    return b"".join(written)


@dataclass(frozen=True)
class Cost:
    per_call_us: float
    per_token_us: float


def measure(short: int, long: int, rounds: int, repeat: int = 20) -> dict[str, Cost]:
    """Each route's cost, from calls of `short` and `long` tokens timed in interleaved rounds."""
    streams = {short: engine_stream(short), long: engine_stream(long)}
    times: dict[tuple[str, int], list[float]] = {(r, n): [] for r in ROUTES for n in streams}
    for _ in range(rounds):
        for route, translator in ROUTES.items():
            for n, stream in streams.items():
                started = time.perf_counter()
                for _ in range(repeat):
                    relay(stream, translator)
                times[route, n].append((time.perf_counter() - started) / repeat * 1e6)
    costs = {}
    for route in ROUTES:
        a, b = statistics.median(times[route, short]), statistics.median(times[route, long])
        per_token = (b - a) / (long - short)
        costs[route] = Cost(per_call_us=a - per_token * short, per_token_us=per_token)
    return costs


def format_costs(costs: dict[str, Cost]) -> str:
    chat = costs["chat completions"]
    lines = [f"{'route':<20}{'us a token':>12}{'x chat':>9}{'us a call':>12}"]
    for route, cost in costs.items():
        ratio = cost.per_token_us / chat.per_token_us if chat.per_token_us > 0 else float("nan")
        lines.append(f"{route:<20}{cost.per_token_us:>12.2f}{ratio:>9.2f}{cost.per_call_us:>12.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=8, help="tokens in the short calls")
    parser.add_argument("--long", type=int, default=64, help="tokens in the long calls")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not 0 < args.short < args.long:
        parser.error("--short must be at least 1 and less than --long")
    print(format_costs(measure(args.short, args.long, args.rounds)))


if __name__ == "__main__":
    main()
