"""One simulation (the real Trainer wired to the simulated world for one window), a sweep of
windows, and the recommendation drawn from it."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollover.config import load_config
from rollover.simulate.distributions import Distribution
from rollover.simulate.world import EPS, SimulatedBackend, SimulatedGateway, VirtualActor, VirtualWeightSync
from rollover.training.settings import TrainerSettings
from rollover.training.trainer import Trainer

DEFAULT_WINDOWS = (1.25, 1.5, 2.0, 3.0, 4.0)


@dataclass(frozen=True)
class Scenario:
    """What the planner is asked about; every window of a sweep shares it."""

    distribution: Distribution
    batch_size: int = 32  # data.train_batch_size: complete groups per update
    n: int = 4  # actor_rollout_ref.rollout.n
    capacity: int | None = None  # max concurrent rollouts; None = batch_size * n
    steps: int = 100
    update_seconds: float = 1.0
    sync_seconds: float = 0.0
    drain_seconds: float = 0.0
    seed: int = 0
    pause_freezes_rollouts: bool = True
    overrides: tuple[str, ...] = ()  # extra config `key=value`, e.g. the staleness cap

    def __post_init__(self) -> None:
        for name in ("batch_size", "n", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {self.capacity})")
        for name in ("update_seconds", "sync_seconds", "drain_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 (got {value})")

    @property
    def agents(self) -> int:
        return self.capacity or self.batch_size * self.n


@dataclass
class SimulationResult:
    window: int  # active prompt groups (= batch_size in sync mode)
    async_enabled: bool
    steps: int
    wall_seconds: float
    updates_per_hour: float
    rollouts_per_second: float  # consumed by updates
    idle_fraction: float  # trainer waiting for groups or the drain, over wall time
    idle_seconds_per_step: float
    mean_carry_over_age: float  # of consumed rollouts, in updates
    max_carry_over_age: int
    mean_version_lag: float  # current policy version minus the one a rollout started under
    max_version_lag: int
    n_aborted_stale_rollouts: int
    history: list[dict[str, float]] = field(default_factory=list, repr=False)

    @property
    def mode(self) -> str:
        return "async" if self.async_enabled else "sync"

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in vars(self).items() if key != "history"} | {"mode": self.mode}


class Simulation:
    """The real Trainer wired to the simulated world for one window (None = synchronous)."""

    def __init__(self, scenario: Scenario, window: int | None = None) -> None:
        self.scenario = scenario
        rng = random.Random(scenario.seed)
        self.backend = SimulatedBackend(scenario.distribution, scenario.agents, rng)
        self.gateway = SimulatedGateway(self.backend, scenario.pause_freezes_rollouts, scenario.drain_seconds)
        overrides = [
            f"data.train_batch_size={scenario.batch_size}",
            f"actor_rollout_ref.rollout.n={scenario.n}",
            f"trainer.total_training_steps={scenario.steps}",
            f"data.seed={scenario.seed}",
            f"trainer.seed={scenario.seed}",
            f"agentlightning.async_rollout.enabled={'true' if window is not None else 'false'}",
            f"agentlightning.async_rollout.async_train_batch_size={window if window is not None else 'null'}",
            *scenario.overrides,
        ]
        config = load_config(None, overrides)
        tasks = [{"id": f"task-{i}"} for i in range(max(window or 0, scenario.batch_size))]
        self.trainer = Trainer(
            settings=TrainerSettings.from_config(config),
            client=self.gateway,  # type: ignore[arg-type]
            actor=VirtualActor(self.backend, scenario.update_seconds),
            weight_sync=VirtualWeightSync(self.backend, scenario.sync_seconds),
            train_tasks=tasks,
            backend=self.backend,
            clock=self.backend.now,
        )

    def run(self) -> SimulationResult:
        history = [m for m in asyncio.run(self.trainer.fit()) if "timing/step_s" in m]
        wall = sum(m["timing/step_s"] for m in history)
        idle = sum(m["timing/trainer_idle_s"] for m in history)
        consumed_rollouts = sum(m["training/async/n_completed_rollouts"] for m in history)
        ages = [c.age_steps for c in self.gateway.consumed]
        return SimulationResult(
            window=self.trainer.settings.window,
            async_enabled=self.trainer.settings.async_enabled,
            steps=len(history),
            wall_seconds=wall,
            updates_per_hour=len(history) * 3600.0 / wall if wall > 0 else math.inf,
            rollouts_per_second=consumed_rollouts / wall if wall > 0 else math.inf,
            idle_fraction=idle / wall if wall > 0 else 0.0,
            idle_seconds_per_step=idle / len(history),
            mean_carry_over_age=statistics.fmean(ages) if ages else 0.0,
            max_carry_over_age=max(ages, default=0),
            mean_version_lag=statistics.fmean(m["policy/version_lag_mean"] for m in history),
            max_version_lag=int(max(m["policy/version_lag_max"] for m in history)),
            n_aborted_stale_rollouts=int(sum(m["training/async/n_aborted_stale_rollouts"] for m in history)),
            history=history,
        )


def simulate(scenario: Scenario, window: int | None = None) -> SimulationResult:
    """Run the trainer for `scenario.steps` updates with `window` active groups (None: sync)."""
    return Simulation(scenario, window).run()


def window_sizes(batch_size: int, multipliers: Sequence[float]) -> list[int]:
    """Windows for the multipliers, each above the batch (the trainer's rule), without repeats."""
    sizes: list[int] = []
    for multiplier in multipliers:
        if not multiplier > 1:
            raise ValueError(f"window multipliers must be > 1 (got {multiplier:g})")
        size = max(math.ceil(multiplier * batch_size - EPS), batch_size + 1)
        if size not in sizes:
            sizes.append(size)
    return sizes


def sweep(scenario: Scenario, multipliers: Sequence[float] = DEFAULT_WINDOWS) -> list[SimulationResult]:
    """Sync first, then one async run per window."""
    windows = window_sizes(scenario.batch_size, multipliers)
    return [simulate(scenario, None), *(simulate(scenario, w) for w in windows)]


def recommend(results: Sequence[SimulationResult], max_staleness: int, tolerance: float = 0.05) -> SimulationResult:
    """The smallest window within `tolerance` of the best throughput whose max carry-over age is
    at most `max_staleness`; failing that, the fastest one under the cap; failing that, the least stale."""
    best = max(r.updates_per_hour for r in results)
    fresh = [r for r in results if r.max_carry_over_age <= max_staleness]
    if not fresh:
        return min(results, key=lambda r: (r.max_carry_over_age, r.window))
    near = [r for r in fresh if r.updates_per_hour >= (1 - tolerance) * best]
    if near:
        return min(near, key=lambda r: r.window)
    return max(fresh, key=lambda r: r.updates_per_hour)
