"""Rollout durations for the planner: parametric distributions (seeded draws), or durations
measured in an earlier run (a JSONL file, a run folder or its store)."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import statistics
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollover.jsonl import jsonl_values


class Distribution(Protocol):
    def draw(self, rng: random.Random) -> float: ...

    def describe(self) -> str: ...


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (got {value!r})")


@dataclass(frozen=True)
class LogNormal:
    median: float = 1.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        _positive("lognormal median", self.median)
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal sigma must be >= 0 (got {self.sigma!r})")

    def draw(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median), self.sigma)

    def describe(self) -> str:
        return f"lognormal(median={self.median:g}s, sigma={self.sigma:g})"


@dataclass(frozen=True)
class Exponential:
    mean: float = 1.0

    def __post_init__(self) -> None:
        _positive("exponential mean", self.mean)

    def draw(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean)

    def describe(self) -> str:
        return f"exponential(mean={self.mean:g}s)"


@dataclass(frozen=True)
class Pareto:
    scale: float = 1.0
    alpha: float = 2.0

    def __post_init__(self) -> None:
        _positive("pareto scale", self.scale)
        # alpha <= 1 has an infinite mean: no throughput to plan for.
        if not (math.isfinite(self.alpha) and self.alpha > 1):
            raise ValueError(f"pareto alpha must be > 1, or the mean duration is infinite (got {self.alpha!r})")

    def draw(self, rng: random.Random) -> float:
        return self.scale * rng.paretovariate(self.alpha)

    def describe(self) -> str:
        return f"pareto(scale={self.scale:g}s, alpha={self.alpha:g})"


@dataclass(frozen=True)
class Constant:
    seconds: float = 1.0

    def __post_init__(self) -> None:
        _positive("constant duration", self.seconds)

    def draw(self, rng: random.Random) -> float:
        return self.seconds

    def describe(self) -> str:
        return f"constant({self.seconds:g}s)"


@dataclass(frozen=True)
class Empirical:
    durations: tuple[float, ...]
    source: str = "given durations"

    def __post_init__(self) -> None:
        if not self.durations:
            raise ValueError(f"{self.source}: no durations")
        for value in self.durations:
            _positive(f"{self.source}: every duration", value)

    def draw(self, rng: random.Random) -> float:
        return rng.choice(self.durations)

    def describe(self) -> str:
        mean = statistics.fmean(self.durations)
        return f"empirical({len(self.durations)} durations from {self.source}, mean {mean:.3g}s)"


def load_durations(path: str | Path) -> Empirical:
    """Measured per-rollout durations: a JSONL file with one `{"duration_s": x}` per line, a run
    folder (its `store.db`), or a store file itself (succeeded rollouts, `finished_at - started_at`)."""
    path = Path(path)
    if path.is_dir():
        store = path / "store.db"
        if not store.is_file():
            raise ValueError(f"{path} is a folder without store.db; pass a run folder or a JSONL file")
        return Empirical(tuple(_durations_from_store(store)), source=str(store))
    if not path.is_file():
        raise ValueError(f"durations file not found: {path}")
    with open(path, "rb") as handle:
        is_sqlite = handle.read(16) == b"SQLite format 3\x00"
    values = _durations_from_store(path) if is_sqlite else _durations_from_jsonl(path)
    return Empirical(tuple(values), source=str(path))


def _durations_from_store(path: Path) -> list[float]:
    query = (
        "SELECT finished_at - started_at FROM rollouts"
        " WHERE state = 'succeeded' AND started_at IS NOT NULL AND finished_at IS NOT NULL"
    )
    try:
        # Read-only: the planner must never touch a run's store.
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            rows = conn.execute(query).fetchall()
    except sqlite3.Error as exc:
        raise ValueError(f"cannot read rollout durations from {path}: {exc}") from None
    # A zero or negative span is a clock artefact, not a duration.
    values = [float(row[0]) for row in rows if row[0] is not None and row[0] > 0]
    if not values:
        raise ValueError(f"{path} holds no succeeded rollout with start and finish times")
    return values


def _durations_from_jsonl(path: Path) -> list[float]:
    values: list[float] = []
    for where, item in jsonl_values(path):
        value = item.get("duration_s") if isinstance(item, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f'{where}: expected {{"duration_s": <seconds > 0>}}, got {json.dumps(item)[:80]}')
        values.append(float(value))
    if not values:
        raise ValueError(f"{path} holds no durations")
    return values
