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
3. A tokenizer trained on the captured prompts (4096 tokens; each code word one token), a
   random-init 2-layer model with a 32k context, and a warm-up in two stages: a copy drill
   (short notes, the code line among decoy lines at a random place, answered with the code:
   the model learns to copy the code word by what it is, not where it sits), then the
   harnesses' transcripts (`sft_warmup(shared_prefix=True)`: the shared prompt runs once per
   step).
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
DRILL_STEPS = 800  # batches of 32 short notes: the copy is learnt between steps ~300 and ~600
# The harnesses' transcripts after the drill: cycles of 150 steps (each a warm-up and a cosine
# decay: warm restarts) at a learning rate low enough to keep the drill's copy.
WARMUP_CYCLES = int(os.environ.get("ROLLOVER_HARNESS_WARMUP_CYCLES", "4"))
CYCLE_STEPS = 150
HEDGE_FRACTION = 0.5
MODEL_NAME = f"tiny-harness-drill{DRILL_STEPS}-warm{WARMUP_CYCLES}x{CYCLE_STEPS}-hedge{round(HEDGE_FRACTION * 100)}"
VOCAB_SIZE = 4096
CONTEXT = 32768
# How often the warm-up sees each harness (a step draws from one): Claude Code's steps run its
# ~12k-token prompt once each, the Agents SDK's are short.
N_CLAUDE, N_AGENTS_SDK = 500, 500

# The task the harnesses are captured on; its values are swapped for each transcript's.
CAPTURE_TASK: dict[str, Any] = {"code": "walrus", "topic": "quartz", "room": 15}


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


def copy_drill(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` short chats: a task's notes with 0-6 decoy lines, its lines in random order, then
    the request for the code and the answer. The code sits at a different place in each, so
    only copying the code word by what it is passes (the harnesses' own transcripts, where it
    always sits at one place, teach a model this small to guess instead)."""
    rng = random.Random(seed)
    things = ["meeting", "budget", "plan", "team", "draft", "review", "notes", "office"]
    chats = []
    for task in tasks.make_tasks(count, seed):
        decoys = [
            f"The {rng.choice(tasks.TOPICS)} {rng.choice(things)} is in room {rng.randint(10, 99)}."
            for _ in range(rng.randint(0, 6))
        ]
        lines = [*decoys]
        for line in tasks.notes_text(task).splitlines():
            lines.insert(rng.randint(0, len(lines)), line)
        ask = "\n".join(lines) + "\nReply with the secret code."
        chats.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer(task)}]})
    return chats


def harness_model(
    out: Path, steps: int = CYCLE_STEPS, drill_steps: int = DRILL_STEPS, cycles: int = WARMUP_CYCLES
) -> Path:
    """The warmed-up tiny model in `out` (built once; a build cut short leaves nothing behind):
    `drill_steps` of the copy drill, then `cycles` of `steps` on the harnesses' transcripts.

    Measured (16 held-out transcripts a harness, sampled at temperature 1): the drill alone
    copies the code in 3-4 answers of 13-16 that name one; a single harness stage at the
    drill's learning rate (3e-3) learns the tool calls but unlearns the copy (1 of 10); four
    cycles at 1e-3 give both: tool calls right 16/16 in each harness, the code right in 8 of 8
    answers that name one (the other half hedge, as the transcripts do)."""
    if cycles < 1:
        raise ValueError(f"cycles must be at least 1, got {cycles}")
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    from rollover.modelzoo.tiny import build_tiny_model
    from rollover.modelzoo.warmup import sft_warmup

    claude = transcripts(capture_claude_code(), N_CLAUDE, seed=11)
    sdk = transcripts(capture_agents_sdk(), N_AGENTS_SDK, seed=12)
    base = out.with_name(f"{out.name}.base-{os.getpid()}")
    drilled = out.with_name(f"{out.name}.drill-{os.getpid()}")
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    # Where each cycle writes: a folder of its own, the last one `staging`.
    cycle_outs = [out.with_name(f"{out.name}.cycle{i}-{os.getpid()}") for i in range(1, cycles)] + [staging]
    try:
        # Each code word a token of its own: the drill's copy is then one token's.
        corpus = _corpus(claude[:2] + sdk[:50]) + [answer({"code": code}) for code in tasks.CODES] * 200
        build_tiny_model(base, vocab_size=VOCAB_SIZE, corpus=corpus, max_position_embeddings=CONTEXT)
        tokenizer = AutoTokenizer.from_pretrained(base)
        _check_code_tokens(tokenizer)
        # One thread: far faster for a model this small on shared cores (see `sft_warmup`).
        drill = sft_warmup(
            base, copy_drill(4000, seed=13), drilled, steps=drill_steps, lr=3e-3, batch_size=32, seed=0, num_threads=1
        )
        metrics: dict[str, Any] = {"copy_drill": drill, "cycles": []}
        previous = drilled
        for cycle, target in enumerate(cycle_outs, start=1):
            done = sft_warmup(
                previous,
                claude + sdk,
                target,
                steps=steps,
                lr=1e-3,
                batch_size=8,
                seed=cycle,
                max_length=None,
                shared_prefix=True,
                num_threads=1,
            )
            metrics["cycles"].append(done)
            previous = target
        prompt_tokens = len(_render(tokenizer, claude[0]))
        metrics |= {"claude_code_transcript_tokens": prompt_tokens}
        (staging / "warmup_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        staging.rename(out)
    finally:
        for partial in (base, drilled, *cycle_outs):
            shutil.rmtree(partial, ignore_errors=True)
    return out


def _check_code_tokens(tokenizer: Any) -> None:
    for code in tasks.CODES:
        ids = tokenizer(f" {code}", add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise RuntimeError(f"the code word {code!r} is {len(ids)} tokens, not one: the tokenizer's corpus lacks it")


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
