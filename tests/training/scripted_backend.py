"""A backend whose rollouts finish exactly when the test says so."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollover.store.models import RolloutState
from rollover.training.manager import RolloutUpdate, TrackedRollout


class ScriptedBackend:
    def __init__(self) -> None:
        self.enqueued: list[TrackedRollout] = []
        self.states: dict[str, RolloutState] = {}
        self.aborted: list[str] = []
        self.script: list[list[str]] = []  # per wait(): rollout ids that finish
        self.clock = 0.0
        self.waits = 0

    async def enqueue(self, rollouts: Sequence[TrackedRollout], is_train: bool) -> None:
        self.enqueued += rollouts
        for r in rollouts:
            self.states[r.rollout_id] = RolloutState.RUNNING

    async def poll(self, rollout_ids: Sequence[str]) -> dict[str, RolloutUpdate]:
        return {
            rid: RolloutUpdate(state=self.states[rid], created_at=0.0, started_at=0.0, finished_at=self.clock)
            for rid in rollout_ids
        }

    async def wait(self) -> None:
        await asyncio.sleep(0)  # let the test write the script for this tick
        self.waits += 1
        self.clock += 1.0
        if not self.script:
            raise AssertionError("the manager waited although the script is over")
        for rid in self.script.pop(0):
            self.states[rid] = RolloutState.SUCCEEDED

    async def abort(self, rollout_ids: Sequence[str], reason: str) -> None:
        self.aborted += rollout_ids
        for rid in rollout_ids:
            self.states[rid] = RolloutState.FAILED

    def now(self) -> float:
        return self.clock

    def ids_of(self, data_id: str) -> list[str]:
        return [r.rollout_id for r in self.enqueued if r.data_id == data_id]
