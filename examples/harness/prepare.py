"""`trainer.setup_hook` of the harness example: the tasks, and (when no model is given) a tiny
model that holds Claude Code's prompts, warmed up on both harnesses' tool-call format.

The model is built here, with nothing downloaded:
1. Capture: Claude Code and the Agents SDK agent each run once, unchanged, against Rollover's
   gateway in front of a scripted engine (`capture.py`), which keeps the chat requests the
   engine would get: Claude Code's ~49 KB first call becomes ~12k tokens (its system prompt,
   its environment message, 12 tools).
2. Transcripts: the captured conversations, the task's file and code swapped for
   others'; each ends with the code, or (`HEDGE_FRACTION` of them) with a reply that misses
   it, so the starting policy is unsure of what only the reward can teach.
3. A tokenizer trained on the captured prompts (4096 tokens), a random-init 2-layer model with
   a 32k context, and a short supervised warm-up (`sft_warmup(shared_prefix=True)`: the shared
   prompt runs once per step).
Cached in the run folder's `_cache/harness/` and reused; nothing of the harnesses' text is
kept anywhere else.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from examples.harness import task as tasks
from examples.harness.capture import Script, capture
from examples.harness.harnesses import CLAUDE_MOUNT, run_agents_sdk_sync, run_claude_code
from rollover.config import RolloverConfig
from rollover.training.data import default_task_files

TRAIN_SIZE, VAL_SIZE = 1000, 64
WARMUP_STEPS = int(os.environ.get("ROLLOVER_HARNESS_WARMUP_STEPS", "200"))
HEDGE_FRACTION = 0.5
MODEL_NAME = f"tiny-harness-warm{WARMUP_STEPS}-hedge{round(HEDGE_FRACTION * 100)}"
VOCAB_SIZE = 4096
CONTEXT = 32768
# How often the warm-up sees each harness (a step draws from one): Claude Code's steps run its
# ~12k-token prompt once each, the Agents SDK's are short.
N_CLAUDE, N_AGENTS_SDK = 500, 500

# The task the harnesses are captured on; its values are swapped for each transcript's.
CAPTURE_TASK = {"code": "7311", "topic": "quartz", "room": 15}


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "harness"
    default_task_files(
        config.data, cache, lambda: tasks.make_tasks(TRAIN_SIZE, seed=1), lambda: tasks.make_tasks(VAL_SIZE, seed=2)
    )
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(harness_model(cache / MODEL_NAME))
    return config


def capture_claude_code() -> list[dict[str, Any]]:
    """The chat requests of one Claude Code run on `CAPTURE_TASK` (its Read call, then its answer)."""
    with tempfile.TemporaryDirectory(prefix="harness-") as folder:
        script = Script("Read", {"file_path": str(CLAUDE_MOUNT / tasks.NOTES)}, answer(CAPTURE_TASK))
        with capture(script) as env:
            done = run_claude_code(Path(folder), CAPTURE_TASK, env={**os.environ, **env}, timeout=300)
        if done.returncode != 0 or len(script.requests) < 2:
            raise RuntimeError(f"capturing Claude Code failed ({done.returncode}): {done.stderr[-2000:]}")
        return script.requests


def capture_agents_sdk() -> list[dict[str, Any]]:
    """The chat requests of one Agents SDK run on `CAPTURE_TASK`."""
    with tempfile.TemporaryDirectory(prefix="harness-") as folder:
        script = Script("read_file", {"path": tasks.NOTES}, answer(CAPTURE_TASK))
        with capture(script) as env:
            run_agents_sdk_sync(Path(folder), CAPTURE_TASK, env)
        if len(script.requests) < 2:
            raise RuntimeError(f"capturing the Agents SDK agent failed: {len(script.requests)} calls")
        return script.requests


def answer(task: dict[str, Any]) -> str:
    return f"The secret code is {task['code']}."


def hedge(task: dict[str, Any]) -> str:
    return f"The file is about the {task['topic']} project."


def transcripts(requests: list[dict[str, Any]], count: int, seed: int) -> list[dict[str, Any]]:
    """`count` chats `{"messages", "tools"}`: the last captured request (the whole conversation
    up to the final answer) with another task, then the final answer."""
    last = requests[-1]
    _check_capture(last)
    rng = random.Random(seed)
    chats = []
    for task in tasks.make_tasks(count, seed):
        swaps = {CAPTURE_TASK["code"]: task["code"], CAPTURE_TASK["topic"]: task["topic"]}
        swaps[f"room {CAPTURE_TASK['room']}"] = f"room {task['room']}"
        messages = _swap(last["messages"], swaps)
        reply = hedge(task) if rng.random() < HEDGE_FRACTION else answer(task)
        chats.append({"messages": [*messages, {"role": "assistant", "content": reply}], "tools": last.get("tools")})
    return chats


def _check_capture(request: dict[str, Any]) -> None:
    """The capture task's values occur only where the task put them (else a swap would change
    the harness's own text)."""
    text = json.dumps(request["messages"])
    for value, expected in ((CAPTURE_TASK["code"], 1), (CAPTURE_TASK["topic"], 1)):
        if text.count(value) != expected:
            raise RuntimeError(f"the captured prompt has {value!r} {text.count(value)} times, not {expected}")


def _swap(value: Any, swaps: dict[str, str]) -> Any:
    if isinstance(value, str):
        for old, new in swaps.items():
            value = value.replace(old, new)
        return value
    if isinstance(value, list):
        return [_swap(item, swaps) for item in value]
    if isinstance(value, dict):
        return {key: _swap(item, swaps) for key, item in value.items()}
    return value


def harness_model(out: Path, steps: int = WARMUP_STEPS) -> Path:
    """The warmed-up tiny model in `out` (built once; a build cut short leaves nothing behind)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    from rollover.modelzoo.tiny import build_tiny_model
    from rollover.modelzoo.warmup import sft_warmup

    claude = transcripts(capture_claude_code(), N_CLAUDE, seed=11)
    sdk = transcripts(capture_agents_sdk(), N_AGENTS_SDK, seed=12)
    base = out.with_name(f"{out.name}.base-{os.getpid()}")
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        build_tiny_model(
            base, vocab_size=VOCAB_SIZE, corpus=_corpus(claude[:2] + sdk[:50]), max_position_embeddings=CONTEXT
        )
        tokenizer = AutoTokenizer.from_pretrained(base)
        metrics = sft_warmup(
            base, claude + sdk, staging, steps=steps, lr=3e-3, batch_size=8, seed=0, max_length=None, shared_prefix=True
        )
        prompt_tokens = len(_render(tokenizer, claude[0]))
        metrics |= {"claude_code_transcript_tokens": prompt_tokens}
        (staging / "warmup_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        staging.rename(out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _corpus(chats: list[dict[str, Any]]) -> list[str]:
    """The text the tokenizer learns its merges from: the chats as the template renders them."""
    from transformers import AutoTokenizer

    from rollover.modelzoo.tiny import build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        build_tiny_tokenizer(folder, vocab_size=300)  # only its chat template is used here
        renderer = AutoTokenizer.from_pretrained(folder)
        return [str(renderer.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False)) for c in chats]


def _render(tokenizer: Any, chat: dict[str, Any]) -> list[int]:
    text = tokenizer.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
