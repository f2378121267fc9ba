"""The simulated world the real Trainer runs against in virtual time: a rollout backend with a
FIFO queue and `capacity` slots, the few gateway calls the trainer makes, and a policy update
and weight sync that only move the virtual clock."""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollover.simulate.distributions import Distribution
from rollover.store.models import ProxyState, Rollout, RolloutState, RolloutStatus, Triplet, TripletBundle
from rollover.training.manager import RolloutUpdate, TrackedRollout

EPS = 1e-9  # rollouts finishing within this many virtual seconds finish together


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
            while (finish := self._next_finish()) is not None and self._now + (finish - self._active) <= target + EPS:
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
        while self._finishing and self._finishing[0][0] <= self._active + EPS:
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

    async def list_models(self) -> list[Any]:
        return []  # the simulated world has agents' durations, not engines

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
            if self._drain_left <= EPS:
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


class VirtualActor:
    """An update that takes `update_seconds` of virtual time and learns nothing."""

    tokenizer: Any = None

    def __init__(self, backend: SimulatedBackend, update_seconds: float) -> None:
        self.backend = backend
        self.update_seconds = update_seconds

    def update(self, batch: Any, rng: random.Random, *, lr: float, kl_coef: float = 0.0) -> dict[str, float]:
        # Runs in `asyncio.to_thread` while the event loop awaits it: nothing else touches the clock.
        self.backend.advance(self.update_seconds)
        return {}

    def save(self, directory: str | Path) -> Path:
        return Path(directory)

    def save_training_state(self, directory: str | Path) -> None:
        return None


class VirtualWeightSync:
    def __init__(self, backend: SimulatedBackend, sync_seconds: float) -> None:
        self.backend = backend
        self.sync_seconds = sync_seconds

    async def before_update(self) -> None:
        return None

    async def sync(self, policy: Any, version: int) -> None:
        self.backend.advance(self.sync_seconds)
        self.backend.policy_version = version
