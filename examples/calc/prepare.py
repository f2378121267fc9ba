"""`trainer.setup_hook` of the calc example: data files and, when no model is given, a tiny
model built locally and warmed up on the protocol. Everything is cached and reused."""

from __future__ import annotations

import os
from pathlib import Path

from examples.calc.task import demonstration, make_tasks
from rollover.config import RolloverConfig
from rollover.training.data import write_tasks

TRAIN_SIZE, VAL_SIZE = 2000, 128
# Short enough that the policy still samples wrong digits at temperature 1 (about half of the
# held-out tasks fail), long enough that it has learned to copy operands and results.
WARMUP_STEPS = int(os.environ.get("ROLLOVER_CALC_WARMUP_STEPS", "300"))


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "calc"
    data = config.data
    if data.train_files is None:
        path = cache / "train.jsonl"
        if not path.exists():
            write_tasks(path, make_tasks(TRAIN_SIZE, seed=1))
        data.train_files = str(path)
    if data.val_files is None:
        path = cache / "val.jsonl"
        if not path.exists():
            write_tasks(path, make_tasks(VAL_SIZE, seed=2, start=TRAIN_SIZE))
        data.val_files = str(path)
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(tiny_calc_model(cache / f"tiny-warm{WARMUP_STEPS}"))
    return config


def tiny_calc_model(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.tiny import build_tiny_model
    from rollover.modelzoo.warmup import sft_warmup

    base = out.with_name(out.name + "-base")
    if not (base / "config.json").exists():
        corpus = [m["content"] for task in make_tasks(500, seed=3) for m in demonstration(task)]
        build_tiny_model(base, corpus=corpus, seed=0)
    examples = [demonstration(task) for task in make_tasks(4000, seed=4, start=10_000)]
    sft_warmup(base, examples, out, steps=WARMUP_STEPS, lr=3e-3, batch_size=16, seed=0)
    return out
