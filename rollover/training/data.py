"""Datasets of task inputs and the prompt loader whose position a checkpoint saves."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollover.config import DataConfig
from rollover.jsonl import jsonl_values
from rollover.training.manager import Prompt


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file with one task input (a JSON object) per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    tasks = []
    for where, item in jsonl_values(path):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        tasks.append(item)
    if not tasks:
        raise ValueError(f"data file {path} holds no tasks")
    return tasks


def write_tasks(path: str | Path, tasks: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for task in tasks:
            handle.write(json.dumps(task) + "\n")
    return path


def default_task_files(
    data: DataConfig,
    cache: Path,
    train: Callable[[], list[dict[str, Any]]],
    val: Callable[[], list[dict[str, Any]]],
) -> None:
    """A setup hook's part: where `data.train_files` / `data.val_files` are unset, point them at
    `cache`/train.jsonl and val.jsonl, written once from `train()` / `val()`."""
    for key, name, make in (("train_files", "train.jsonl", train), ("val_files", "val.jsonl", val)):
        if getattr(data, key) is None:
            path = cache / name
            if not path.exists():
                write_tasks(path, make())
            setattr(data, key, str(path))


class PromptLoader:
    """Endless shuffled passes over the tasks; every draw gets a unique group key (`data_id`),
    so the same task drawn again while its earlier group is still active never merges with it."""

    def __init__(self, tasks: list[dict[str, Any]], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("the dataset is empty")
        self.tasks = tasks
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.draws = 0
        self.requeued: list[dict[str, Any]] = []
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def _key(self, index: int) -> str:
        self.draws += 1
        task_id = self.tasks[index].get("id", index)
        return f"{task_id}#{self.draws}"

    def take(self, count: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        while self.requeued and len(prompts) < count:
            item = self.requeued.pop(0)
            self.draws += 1
            prompts.append(Prompt(data_id=f"{item['task_id']}#{self.draws}", input=item["input"]))
        while len(prompts) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._shuffled(self.epoch)
            index = self._order[self.position]
            self.position += 1
            prompts.append(Prompt(data_id=self._key(index), input=self.tasks[index]))
        return prompts

    def requeue(self, prompt: Prompt) -> None:
        self.requeued.append({"task_id": prompt.data_id.split("#", 1)[0], "input": prompt.input})

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "draws": self.draws, "requeued": list(self.requeued)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.draws = state["draws"]
        self.requeued = list(state.get("requeued", []))
        self._order = self._shuffled(self.epoch)
