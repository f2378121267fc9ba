"""`rollover simulate`: a discrete-event capacity planner for the async rollout window.

It runs the real `Trainer` — staleness cap, window top-up, `AsyncRolloutManager`, carry-over,
pause/drain, update, weight sync — in virtual time. Only the outside world is simulated:
`SimulatedBackend` plays the rollouts, `SimulatedGateway` the few gateway calls the trainer
makes, and the policy update and weight sync just move the virtual clock. So the numbers come
from the scheduling code a real run executes, not from a model of it.

The model, stated once:

- Every rollout needs `duration` seconds of *active* time, drawn (seeded) from a distribution:
  parametric, or durations measured in an earlier run.
- At most `capacity` rollouts run at once (agents, or what the engine serves at full speed);
  the rest wait in a FIFO queue. The default is `batch_size * n`, what a synchronous step keeps
  busy, so a bigger window can only win through duration variance, not extra parallelism.
- `pause_freezes_rollouts` (default on): while the trainer updates and syncs weights, running
  rollouts make no progress, because a collocated engine serves nothing then and every agent
  stalls at its next model call. Switch it off for an engine that keeps serving during updates.
- A pause drains in `drain_seconds` when any rollout is running (rollouts progress while it
  drains), instantly otherwise.
- A rollout's tokens carry the policy version it started under; the version lag counts from it.

Measured durations include any time a rollout spent frozen by a pause, so durations from an
async run overstate the active time somewhat; durations from a sync run do not.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import sqlite3
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollover.config import ConfigError, load_config
from rollover.store.models import ProxyState, Rollout, RolloutState, RolloutStatus, Triplet, TripletBundle
from rollover.training.manager import RolloutUpdate, TrackedRollout
from rollover.training.trainer import DrainTimeout, Trainer

DEFAULT_WINDOWS = (1.25, 1.5, 2.0, 3.0, 4.0)
_EPS = 1e-9  # rollouts finishing within this many virtual seconds finish together


# -- duration distributions -----------------------------------------------------------------


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
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{number}: not valid JSON") from None
            value = item.get("duration_s") if isinstance(item, dict) else None
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f'{path}:{number}: expected {{"duration_s": <seconds > 0>}}, got {line.strip()[:80]}')
            values.append(float(value))
    if not values:
        raise ValueError(f"{path} holds no durations")
    return values


# -- the ideal speed-up ---------------------------------------------------------------------


def ideal_step_seconds(
    durations: Distribution | Sequence[float],
    batch_groups: int,
    n: int,
    update_seconds: float,
    capacity: int | None = None,
    pause_freezes_rollouts: bool = True,
    trials: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """(expected synchronous step, ideal asynchronous step) in seconds; see `ideal_speedup`."""
    distribution = Empirical(tuple(durations)) if isinstance(durations, Sequence) else durations
    k = batch_groups * n
    agents = capacity or k
    rng = random.Random(seed)
    makespans: list[float] = []
    total = 0.0
    for _ in range(trials):
        batch = [distribution.draw(rng) for _ in range(k)]
        total += sum(batch)
        makespans.append(_fifo_makespan(batch, min(agents, k)))
    mean_duration = total / (trials * k)
    sync_step = statistics.fmean(makespans) + update_seconds
    rollout_phase = k * mean_duration / agents
    async_step = rollout_phase + update_seconds if pause_freezes_rollouts else max(rollout_phase, update_seconds)
    return sync_step, async_step


def ideal_speedup(
    durations: Distribution | Sequence[float],
    batch_groups: int,
    n: int,
    update_seconds: float,
    capacity: int | None = None,
    pause_freezes_rollouts: bool = True,
    trials: int = 2000,
    seed: int = 0,
) -> float:
    """The most an async window can gain over synchronous rollout for this distribution.

    With k = batch_groups * n rollouts per update, c = capacity agents (default k) and U the
    time the trainer does not roll out per step (update, plus weight sync if you include it):

        T_sync  = E[makespan of k rollouts on min(c, k) agents, FIFO] + U
                  (= E[max of k durations] + U when c >= k)
        T_async = k * E[duration] / c + U           (rollouts frozen during the update)
                  max(k * E[duration] / c, U)       (rollouts progress during the update)
        speed-up = T_sync / T_async

    T_async is a throughput bound: all c agents always busy and every finished rollout used,
    so no group ever waits for a straggler. No real window reaches it; it says how much the
    duration variance leaves on the table. Both expectations are Monte Carlo estimates over
    `trials` batches drawn from the same distribution (a sequence of floats is resampled).
    """
    sync_step, async_step = ideal_step_seconds(
        durations, batch_groups, n, update_seconds, capacity, pause_freezes_rollouts, trials, seed
    )
    return sync_step / async_step


def _fifo_makespan(durations: list[float], agents: int) -> float:
    if agents >= len(durations):
        return max(durations)
    free_at = [0.0] * agents
    for duration in durations:
        heapq.heappush(free_at, heapq.heappop(free_at) + duration)
    return max(free_at)


# -- the simulated world --------------------------------------------------------------------


@dataclass
class SimRollout:
    rollout_id: str
    data_id: str
    enqueued_step: int
    duration: float
    created_at: float
    state: RolloutState = RolloutState.QUEUING
    started_at: float | None = None
    finished_at: float | None = None
    started_version: int | None = None
    error_message: str | None = None


class SimulatedBackend:
    """A `RolloutBackend` on a virtual clock: FIFO queue, `capacity` slots, drawn durations.

    Two clocks: `now()` is virtual wall time; `_active` advances only while rollouts progress
    (not while frozen), and each running rollout finishes at a fixed point of it.
    """

    def __init__(self, distribution: Distribution, capacity: int, rng: random.Random) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.distribution = distribution
        self.capacity = capacity
        self.rng = rng
        self.rollouts: dict[str, SimRollout] = {}
        self.policy_version = 0  # set by the weight sync
        self.frozen = False  # set by the gateway's pause/resume
        self.groups_settled = 0  # groups whose members are all terminal
        self._updates: dict[str, RolloutUpdate] = {}
        self._queue: deque[str] = deque()
        self._running: set[str] = set()
        self._finishing: list[tuple[float, int, str]] = []  # (active time at finish, start order, id)
        self._group_left: dict[str, int] = {}
        self._now = 0.0
        self._active = 0.0
        self._starts = 0

    # RolloutBackend

    async def enqueue(self, rollouts: Sequence[TrackedRollout], is_train: bool) -> None:
        for tracked in rollouts:
            sim = SimRollout(
                rollout_id=tracked.rollout_id,
                data_id=tracked.data_id,
                enqueued_step=tracked.enqueued_step,
                duration=self.distribution.draw(self.rng),
                created_at=self._now,
            )
            self.rollouts[sim.rollout_id] = sim
            self._group_left[sim.data_id] = self._group_left.get(sim.data_id, 0) + 1
            self._queue.append(sim.rollout_id)
            self._publish(sim)
        self._start_queued()

    async def poll(self, rollout_ids: Sequence[str]) -> dict[str, RolloutUpdate]:
        return {rid: self._updates[rid] for rid in rollout_ids if rid in self._updates}

    async def wait(self) -> None:
        # Stepping to the next group that settles (not the next single rollout) changes nothing
        # for the manager, which only counts whole groups, and saves it many polls.
        if self.frozen:
            raise RuntimeError("the trainer waits for rollouts while the gateway is paused")
        settled = self.groups_settled
        while self.groups_settled == settled:
            finish = self._next_finish()
            if finish is None:
                raise RuntimeError("no rollout is running, so no group can complete")
            self._run_to(finish)

    async def abort(self, rollout_ids: Sequence[str], reason: str) -> None:
        for rid in rollout_ids:
            sim = self.rollouts.get(rid)
            if sim is not None and not sim.state.terminal:
                self._settle(sim, RolloutState.FAILED, f"aborted: {reason}")
        self._start_queued()

    def now(self) -> float:
        return self._now

    # the simulated trainer and gateway

    @property
    def running_count(self) -> int:
        return len(self._running)

    def advance(self, seconds: float) -> None:
        """Let `seconds` of virtual time pass; rollouts progress unless frozen."""
        target = self._now + seconds
        if not self.frozen:
            while (finish := self._next_finish()) is not None and self._now + (finish - self._active) <= target + _EPS:
                self._run_to(finish)
            self._active += max(target - self._now, 0.0)
        self._now = max(target, self._now)

    # internals

    def _next_finish(self) -> float | None:
        while self._finishing and self._finishing[0][2] not in self._running:
            heapq.heappop(self._finishing)  # aborted while running
        return self._finishing[0][0] if self._finishing else None

    def _run_to(self, finish: float) -> None:
        self._now += finish - self._active
        self._active = finish
        while self._finishing and self._finishing[0][0] <= self._active + _EPS:
            _, _, rid = heapq.heappop(self._finishing)
            if rid in self._running:
                self._settle(self.rollouts[rid], RolloutState.SUCCEEDED, None)
        self._start_queued()

    def _start_queued(self) -> None:
        while self._queue and len(self._running) < self.capacity:
            sim = self.rollouts[self._queue.popleft()]
            if sim.state != RolloutState.QUEUING:
                continue  # aborted while queued
            sim.state = RolloutState.RUNNING
            sim.started_at = self._now
            sim.started_version = self.policy_version
            self._running.add(sim.rollout_id)
            heapq.heappush(self._finishing, (self._active + sim.duration, self._starts, sim.rollout_id))
            self._starts += 1
            self._publish(sim)

    def _settle(self, sim: SimRollout, state: RolloutState, error: str | None) -> None:
        self._running.discard(sim.rollout_id)
        sim.state = state
        sim.finished_at = self._now
        sim.error_message = error
        self._publish(sim)
        self._group_left[sim.data_id] -= 1
        if self._group_left[sim.data_id] == 0:
            self.groups_settled += 1

    def _publish(self, sim: SimRollout) -> None:
        self._updates[sim.rollout_id] = RolloutUpdate(
            state=sim.state,
            created_at=sim.created_at,
            started_at=sim.started_at,
            finished_at=sim.finished_at,
            error_message=sim.error_message,
        )


@dataclass
class ConsumedRollout:
    """A rollout whose samples the trainer fetched, as the gateway saw it at that moment."""

    rollout_id: str
    data_id: str
    state: RolloutState
    age_steps: int  # updates between enqueue and consumption; 0 = used in the step that enqueued it


class SimulatedGateway:
    """The `GatewayClient` calls the Trainer makes, answered from the simulated backend."""

    def __init__(
        self, backend: SimulatedBackend, pause_freezes_rollouts: bool = True, drain_seconds: float = 0.0
    ) -> None:
        self.backend = backend
        self.pause_freezes_rollouts = pause_freezes_rollouts
        self.drain_seconds = drain_seconds
        self.consumed: list[ConsumedRollout] = []
        self.announced_pauses: list[float | None] = []  # the trainer's `expected_seconds`, per pause
        self._paused = False
        self._reason: str | None = None
        self._retry_after = 5.0
        self._drain_left = 0.0
        self._inflight = 0

    async def resume(self) -> ProxyState:
        self._paused = False
        self._reason = None
        self.backend.frozen = False
        return self._state()

    async def pause(
        self, reason: str | None = None, retry_after_seconds: float = 5.0, expected_seconds: float | None = None
    ) -> ProxyState:
        self.announced_pauses.append(expected_seconds)
        self._paused = True
        self._reason = reason
        self._retry_after = retry_after_seconds
        # One call in flight per running rollout, all done after `drain_seconds`.
        running = self.backend.running_count
        self._inflight = running if self.drain_seconds > 0 else 0
        self._drain_left = self.drain_seconds if self._inflight else 0.0
        if not self._inflight:
            self.backend.frozen = self.pause_freezes_rollouts
        return self._state()

    async def proxy_state(self, wait_drained: float | None = None) -> ProxyState:
        if self._inflight:
            step = self._drain_left if wait_drained is None else min(wait_drained, self._drain_left)
            self.backend.advance(step)
            self._drain_left -= step
            if self._drain_left <= _EPS:
                self._inflight = 0
                self.backend.frozen = self.pause_freezes_rollouts
        return self._state()

    async def list_rollouts(
        self,
        state_in: Sequence[RolloutState] | None = None,
        rollout_ids: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        known = self.backend.rollouts
        chosen = [known[r] for r in rollout_ids if r in known] if rollout_ids is not None else known.values()
        found = [
            Rollout(
                rollout_id=sim.rollout_id,
                status=RolloutStatus(state=sim.state, error_message=sim.error_message),
                created_at=sim.created_at,
                updated_at=sim.finished_at or sim.started_at or sim.created_at,
                started_at=sim.started_at,
                finished_at=sim.finished_at,
            )
            for sim in chosen
            if state_in is None or sim.state in state_in
        ]
        return found[:limit] if limit is not None else found

    async def triplets(self, rollout_id: str, attempt_id: str | None = None) -> TripletBundle:
        sim = self.backend.rollouts[rollout_id]
        self.consumed.append(
            ConsumedRollout(rollout_id, sim.data_id, sim.state, self.backend.policy_version - sim.enqueued_step)
        )
        if sim.state != RolloutState.SUCCEEDED or sim.started_version is None:
            return TripletBundle(rollout_id=rollout_id, attempt_id=None, reward=None, triplets=[])
        # One model call of one token, so every rollout yields exactly one sample.
        call = Triplet(
            event_id=0,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[0.0],
            policy_version=sim.started_version,
        )
        return TripletBundle(rollout_id=rollout_id, attempt_id="sim", reward=1.0, triplets=[call])

    def _state(self) -> ProxyState:
        return ProxyState(
            paused=self._paused, retry_after_seconds=self._retry_after, reason=self._reason, inflight=self._inflight
        )


class VirtualPolicy:
    """An update that takes `update_seconds` of virtual time and learns nothing."""

    tokenizer: Any = None

    def __init__(self, backend: SimulatedBackend, update_seconds: float) -> None:
        self.backend = backend
        self.update_seconds = update_seconds

    def update(self, samples: Sequence[Any], rng: random.Random) -> dict[str, float]:
        # Runs in `asyncio.to_thread` while the event loop awaits it: nothing else touches the clock.
        self.backend.advance(self.update_seconds)
        return {}

    def save(self, directory: str | Path) -> Path:
        return Path(directory)


class VirtualWeightSync:
    def __init__(self, backend: SimulatedBackend, sync_seconds: float) -> None:
        self.backend = backend
        self.sync_seconds = sync_seconds

    async def before_update(self) -> None:
        return None

    async def sync(self, policy: Any, version: int) -> None:
        self.backend.advance(self.sync_seconds)
        self.backend.policy_version = version


# -- one simulation -------------------------------------------------------------------------


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
            config=config,
            client=self.gateway,  # type: ignore[arg-type]
            policy=VirtualPolicy(self.backend, scenario.update_seconds),
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
            window=self.trainer.window_size,
            async_enabled=self.trainer.async_enabled,
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
        size = max(math.ceil(multiplier * batch_size - _EPS), batch_size + 1)
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


# -- the command ----------------------------------------------------------------------------


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


_PARAMS = {
    "lognormal": ("median", "sigma"),
    "exponential": ("mean",),
    "pareto": ("scale", "alpha"),
    "constant": ("duration",),
    "empirical": (),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollover simulate",
        description=(
            "Capacity planner: runs the real trainer loop in virtual time with simulated rollout "
            "durations, for sync mode and a sweep of async windows, and recommends "
            "agentlightning.async_rollout.async_train_batch_size."
        ),
    )
    parser.add_argument("--batch-size", type=_count(1), default=32, help="data.train_batch_size (default 32)")
    parser.add_argument("--n", type=_count(1), default=4, help="actor_rollout_ref.rollout.n (default 4)")
    parser.add_argument(
        "--windows", default=",".join(f"{m:g}" for m in DEFAULT_WINDOWS), help="window sizes as multiples of the batch"
    )
    parser.add_argument("--distribution", choices=sorted(_PARAMS), default=None, help="default lognormal")
    parser.add_argument("--median", type=float, help="lognormal median seconds (default 1)")
    parser.add_argument("--sigma", type=float, help="lognormal sigma (default 1)")
    parser.add_argument("--mean", type=float, help="exponential mean seconds (default 1)")
    parser.add_argument("--scale", type=float, help="pareto minimum seconds (default 1)")
    parser.add_argument("--alpha", type=float, help="pareto shape, > 1 (default 2)")
    parser.add_argument("--duration", type=float, help="constant seconds (default 1)")
    parser.add_argument(
        "--durations",
        metavar="FILE_OR_RUN_DIR",
        help='measured durations: JSONL of {"duration_s": x}, or a run folder (reads its store.db)',
    )
    parser.add_argument("--capacity", type=_count(1), default=None, help="max concurrent rollouts (default batch*n)")
    parser.add_argument("--steps", type=_count(1), default=100, help="updates per simulation (default 100)")
    parser.add_argument("--update-seconds", type=_seconds, default=1.0, help="time of one policy update (default 1)")
    parser.add_argument("--sync-seconds", type=_seconds, default=0.0, help="time of one weight sync (default 0)")
    parser.add_argument("--drain-seconds", type=_seconds, default=0.0, help="time a pause takes to drain (default 0)")
    parser.add_argument(
        "--pause-freezes-rollouts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rollouts make no progress during update and sync (collocated engine; default on)",
    )
    parser.add_argument(
        "--max-carry-over-age",
        type=_count(0),
        default=None,
        help="the trainer's agentlightning.async_rollout.max_carry_over_age_steps (default none)",
    )
    parser.add_argument(
        "--max-staleness",
        type=_count(0),
        default=4,
        help="recommend no window whose max carry-over age exceeds this (default 4)",
    )
    parser.add_argument(
        "--tolerance",
        type=_fraction,
        default=0.05,
        help="throughput within this fraction of the best counts as best (default 0.05)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def _distribution(args: argparse.Namespace) -> Distribution:
    kind = args.distribution or ("empirical" if args.durations else "lognormal")
    if args.durations and kind != "empirical":
        raise ValueError(f"--durations reads measured durations; it cannot be combined with --distribution {kind}")
    if kind == "empirical" and not args.durations:
        raise ValueError("--distribution empirical needs --durations FILE_OR_RUN_DIR")
    for kind_name, names in _PARAMS.items():
        for name in names:
            if kind_name != kind and name not in _PARAMS[kind] and getattr(args, name) is not None:
                raise ValueError(f"--{name} applies to --distribution {kind_name}, not {kind}")

    def given(name: str, default: float) -> float:
        value = getattr(args, name)
        return default if value is None else value

    if kind == "lognormal":
        return LogNormal(given("median", 1.0), given("sigma", 1.0))
    if kind == "exponential":
        return Exponential(given("mean", 1.0))
    if kind == "pareto":
        return Pareto(given("scale", 1.0), given("alpha", 2.0))
    if kind == "constant":
        return Constant(given("duration", 1.0))
    return load_durations(args.durations)


def _multipliers(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--windows must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError("--windows needs at least one multiplier")
    return values


def _table(scenario: Scenario, results: Sequence[SimulationResult]) -> str:
    # Aborts happen only under the trainer's staleness cap; the column would be noise otherwise.
    aborts = any(r.n_aborted_stale_rollouts for r in results)
    header = f"{'mode':<12}{'window':>7}{'updates/h':>11}{'rollouts/s':>12}{'idle':>7}{'age mean':>10}{'age max':>9}{'lag mean':>10}"
    header += f"{'aborted':>9}" if aborts else ""
    lines = [header, "-" * len(header)]
    for r in results:
        label = "sync" if not r.async_enabled else f"async {r.window / scenario.batch_size:g}x"
        line = (
            f"{label:<12}{r.window:>7}{r.updates_per_hour:>11.1f}{r.rollouts_per_second:>12.2f}"
            f"{r.idle_fraction:>7.0%}{r.mean_carry_over_age:>10.2f}{r.max_carry_over_age:>9}{r.mean_version_lag:>10.2f}"
        )
        lines.append(line + (f"{r.n_aborted_stale_rollouts:>9}" if aborts else ""))
    return "\n".join(lines)


def _recommendation_text(results: Sequence[SimulationResult], choice: SimulationResult, max_staleness: int) -> str:
    sync = results[0]
    gain = choice.updates_per_hour / sync.updates_per_hour
    if choice.async_enabled:
        text = (
            "recommended: agentlightning.async_rollout.enabled=true "
            f"agentlightning.async_rollout.async_train_batch_size={choice.window}  "
            f"({gain:.2f}x sync throughput, max carry-over age {choice.max_carry_over_age} <= {max_staleness})"
        )
    else:
        text = "recommended: synchronous (agentlightning.async_rollout.enabled=false)"
    best = max(results, key=lambda r: r.updates_per_hour)
    if best.max_carry_over_age > max_staleness and best.updates_per_hour > choice.updates_per_hour:
        text += (
            f"\nnote: window {best.window} is {best.updates_per_hour / choice.updates_per_hour:.2f}x faster but its max "
            f"carry-over age {best.max_carry_over_age} exceeds --max-staleness {max_staleness}; raise it, or cap the "
            "trainer with --max-carry-over-age (agentlightning.async_rollout.max_carry_over_age_steps)"
        )
    return text


def main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage and the message (or the help)
        return int(exc.code or 0)
    try:
        overrides = (
            (f"agentlightning.async_rollout.max_carry_over_age_steps={args.max_carry_over_age}",)
            if args.max_carry_over_age is not None
            else ()
        )
        scenario = Scenario(
            distribution=_distribution(args),
            batch_size=args.batch_size,
            n=args.n,
            capacity=args.capacity,
            steps=args.steps,
            update_seconds=args.update_seconds,
            sync_seconds=args.sync_seconds,
            drain_seconds=args.drain_seconds,
            seed=args.seed,
            pause_freezes_rollouts=args.pause_freezes_rollouts,
            overrides=overrides,
        )
        multipliers = _multipliers(args.windows)
        window_sizes(scenario.batch_size, multipliers)  # reject bad multipliers before any run
        load_config(None, overrides)
    except (ValueError, ConfigError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2

    try:
        results = sweep(scenario, multipliers)
    except DrainTimeout as exc:  # the trainer itself would stop here: say so, as a real run would
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    choice = recommend(results, args.max_staleness, args.tolerance)
    sync_step, async_step = ideal_step_seconds(
        scenario.distribution,
        scenario.batch_size,
        scenario.n,
        scenario.update_seconds + scenario.sync_seconds,
        scenario.agents,
        scenario.pause_freezes_rollouts,
        seed=scenario.seed,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "distribution": scenario.distribution.describe(),
                    "batch_size": scenario.batch_size,
                    "n": scenario.n,
                    "capacity": scenario.agents,
                    "steps": scenario.steps,
                    "update_seconds": scenario.update_seconds,
                    "sync_seconds": scenario.sync_seconds,
                    "drain_seconds": scenario.drain_seconds,
                    "pause_freezes_rollouts": scenario.pause_freezes_rollouts,
                    "seed": scenario.seed,
                    "results": [r.to_json() for r in results],
                    "ideal_speedup": sync_step / async_step,
                    "ideal_sync_step_seconds": sync_step,
                    "ideal_async_step_seconds": async_step,
                    "recommended_window": choice.window if choice.async_enabled else None,
                }
            )
        )
        return 0
    freeze = "frozen" if scenario.pause_freezes_rollouts else "running"
    print(
        f"{scenario.distribution.describe()}; batch {scenario.batch_size} groups x n {scenario.n}; "
        f"capacity {scenario.agents} rollouts; {scenario.steps} updates of {scenario.update_seconds:g}s "
        f"+ sync {scenario.sync_seconds:g}s; rollouts {freeze} during updates"
    )
    print(_table(scenario, results))
    k = scenario.batch_size * scenario.n
    rollout_phase = f"{k} x mean duration / {scenario.agents} agents"
    ideal = f"{rollout_phase} + update" if scenario.pause_freezes_rollouts else f"max({rollout_phase}, update)"
    print(
        f"ideal async speed-up: {sync_step / async_step:.2f}x  "
        f"(sync step {sync_step:.2f}s = slowest of {k} rollouts + update; ideal async step {async_step:.2f}s = {ideal})"
    )
    print(_recommendation_text(results, choice, args.max_staleness))
    return 0
