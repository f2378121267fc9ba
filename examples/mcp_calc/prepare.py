"""`trainer.setup_hook` of the MCP calculator example: word problems and, when no model is
given, SmolLM2-135M-Instruct with a short warm-up on tool-call transcripts (the generic
ones of the model zoo plus calls of this example's `calculate` tool). Cached and reused."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from rollover.config import RolloverConfig
from rollover.modelzoo.toolcalls import DEFAULT_TOOLS, ToolSpec, tool_call_transcripts, warm_up_tool_calls
from rollover.training.data import default_task_files

TRAIN_SIZE, VAL_SIZE = 1000, 64
WARMUP_STEPS = int(os.environ.get("ROLLOVER_MCP_CALC_WARMUP_STEPS", "60"))
MODEL_NAME = f"smollm2-tools{WARMUP_STEPS}"
INSTRUCTIONS = "Solve the problem. Use the calculate tool for arithmetic, then state the result."


def make_tasks(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tasks = []
    for _ in range(count):
        a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 9)
        people = rng.choice(["Ana", "Bo", "Chen", "Dara", "Eli"])
        question = f"{people} has {a} apples and buys {b} more, then packs them {c} times over. How many is that?"
        tasks.append({"question": question, "expression": f"({a} + {b}) * {c}", "answer": str((a + b) * c)})
    return tasks


def _calc_tool() -> ToolSpec:
    def make(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
        task = make_tasks(1, rng.randrange(1 << 30))[0]
        return task["question"], {"expression": task["expression"]}, task["answer"], f"That is {task['answer']}."

    return ToolSpec("calculate", "Evaluate an arithmetic expression.", {"expression": "string"}, make)


def warmup_transcripts(count: int = 2000) -> list[dict[str, Any]]:
    """Half generic tool calls, half this example's: its system prompt, its tool only."""
    generic = tool_call_transcripts(count // 2, seed=6, tools=DEFAULT_TOOLS)
    own = tool_call_transcripts(count - count // 2, seed=7, tools=[_calc_tool()], system=INSTRUCTIONS)
    return generic + own


def smollm2_tools_model(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.smollm2 import cached_smollm2

    base = cached_smollm2(out.parent.parent / "smollm2")  # shared with the other examples
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    metrics = warm_up_tool_calls(base, staging, steps=WARMUP_STEPS, transcripts=warmup_transcripts())
    (staging / "warmup_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    staging.rename(out)
    return out


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "mcp_calc"
    default_task_files(config.data, cache, lambda: make_tasks(TRAIN_SIZE, seed=1), lambda: make_tasks(VAL_SIZE, seed=2))
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(smollm2_tools_model(cache / MODEL_NAME))
    return config
