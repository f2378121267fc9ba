"""What the end-to-end tests share: the seed's metric names, spelled as SPEC §4 spells them
(not imported from the package, so a renamed metric fails here), and a short run read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollover.config import load_config
from rollover.launch import run_training
from rollover.metrics import read_jsonl

SEED_ASYNC_METRICS = (
    "training/async/n_prev_carry_over_rollouts",
    "training/async/n_completed_rollouts",
    "training/async/n_new_carry_over_rollouts",
    "training/async/new_carry_over_age_max_steps",
    "training/async/proxy_inflight_at_pause",
    "training/async/proxy_drain_seconds",
)
SEED_TIMING_METRICS = tuple(
    f"timing/rollout_{name}/{stat}"
    for name in ("queue_wait_s", "run_duration_s", "total_s")
    for stat in ("mean", "p50", "p90", "max")
)

Rows = list[dict[str, Any]]


def train_briefly(
    config_path: Path, tmp_path: Path, model: Path, name: str, steps: int, *overrides: str, engine: Any
) -> tuple[Rows, Rows]:
    """`steps` updates of `config_path` on `model` through the real system (the session's
    vLLM `engine`); the run's metrics rows: (training steps, held-out evaluations)."""
    config = load_config(
        config_path,
        [
            f"trainer.default_local_dir={tmp_path}",
            f"trainer.experiment_name={name}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.total_training_steps={steps}",
            *overrides,
        ],
    )
    assert run_training(config, engine=engine) == 0
    rows = read_jsonl(tmp_path / name / "metrics.jsonl")
    train = [r for r in rows if "training/async/n_completed_rollouts" in r]
    val = [r for r in rows if "val/reward_mean" in r]
    assert len(train) == steps
    for row in train:
        for key in (*SEED_ASYNC_METRICS, *SEED_TIMING_METRICS):
            assert key in row, key
    return train, val
