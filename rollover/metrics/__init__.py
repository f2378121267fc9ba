"""Metric sinks: a console line per step, a JSONL file in the run folder, and W&B."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast, get_args

from rich.console import Console

WandbMode = Literal["online", "offline", "disabled", "shared"]
_WANDB_MODES = frozenset(get_args(WandbMode))

CONSOLE_KEYS = (
    ("critic/score/mean", "reward", "{:.3f}"),
    ("val/reward_mean", "val", "{:.3f}"),
    ("actor/pg_loss", "loss", "{:+.4f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("training/n_filtered_groups", "filtered", "{:.0f}"),
    ("training/async/n_prev_carry_over_rollouts", "carry_in", "{:.0f}"),
    ("training/async/n_new_carry_over_rollouts", "carry_out", "{:.0f}"),
    ("training/async/proxy_drain_seconds", "drain_s", "{:.2f}"),
    ("timing/step_s", "step_s", "{:.1f}"),
    ("timing/trainer_idle_fraction", "idle", "{:.0%}"),
)


def summarize(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """`{prefix}/mean|p50|p90|max` of the values (empty input → no keys)."""
    if not values:
        return {}
    ordered = sorted(values)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {
        f"{prefix}/mean": statistics.fmean(ordered),
        f"{prefix}/p50": quantile(0.5),
        f"{prefix}/p90": quantile(0.9),
        f"{prefix}/max": ordered[-1],
    }


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        loggers: Iterable[str],
        *,
        project: str = "rollover",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        console: Console | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = set(loggers)
        self.console = console or Console(stderr=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._jsonl = None
        if "jsonl" in self.loggers:
            drop_torn_row(self.jsonl_path)
            self._jsonl = open(self.jsonl_path, "a")
        self._wandb = None
        if "wandb" in self.loggers:
            import wandb

            # Offline unless the user asked for online explicitly: runs never need a network.
            mode = os.environ.get("WANDB_MODE", "offline")
            if mode not in _WANDB_MODES:
                raise ValueError(f"WANDB_MODE={mode!r}: use one of {', '.join(get_args(WandbMode))}")
            self._wandb = wandb.init(
                project=project,
                name=experiment,
                dir=str(self.run_dir),
                mode=cast(WandbMode, mode),
                config=dict(config or {}),
                reinit="finish_previous",
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if "console" in self.loggers:
            parts = [f"step {step}"]
            for key, label, fmt in CONSOLE_KEYS:
                if key in clean:
                    parts.append(f"{label}={fmt.format(clean[key])}")
            self.console.print(" ".join(parts), highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def drop_torn_row(path: Path) -> None:
    """Cut a last row that has no newline: a run killed while writing it left it half-written,
    and a resumed run's first row would otherwise be glued onto it (one line no reader parses)."""
    if not path.is_file():
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if data and not data.endswith(b"\n"):
            handle.truncate(data.rfind(b"\n") + 1)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
