"""The active window of prompt groups: enqueue, wait for complete groups, carry the rest over.

`AsyncRolloutManager` is the seed's `AglAsyncRolloutManager`. It talks to a `RolloutBackend`
(the gateway in a real run, a discrete-event simulation in `rollover simulate`), so the
planner exercises exactly the scheduling code the trainer runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollover.metrics.progress import WindowStatus
from rollover.store.models import RolloutState, new_rollout_id


@dataclass
class Prompt:
    """One dataset item; `n` sibling rollouts of it form a group keyed by `data_id`."""

    data_id: str
    input: Any


@dataclass
class TrackedRollout:
    rollout_id: str
    data_id: str
    input: Any
    enqueued_step: int  # trainer step (= policy version) when the group was enqueued
    state: RolloutState = RolloutState.QUEUING
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error_message: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "data_id": self.data_id,
            "input": self.input,
            "enqueued_step": self.enqueued_step,
            "state": self.state.value,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrackedRollout:
        return cls(
            rollout_id=data["rollout_id"],
            data_id=data["data_id"],
            input=data["input"],
            enqueued_step=data["enqueued_step"],
            state=RolloutState(data["state"]),
        )


@dataclass
class RolloutUpdate:
    state: RolloutState
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error_message: str | None = None


class RolloutBackend(Protocol):
    async def enqueue(self, rollouts: Sequence[TrackedRollout], is_train: bool) -> None: ...

    async def poll(self, rollout_ids: Sequence[str]) -> dict[str, RolloutUpdate]: ...

    async def wait(self) -> None:
        """Return when states may have changed (after a poll interval, or simulated time)."""

    async def abort(self, rollout_ids: Sequence[str], reason: str) -> None: ...

    def now(self) -> float: ...


@dataclass
class GroupedResult:
    completed_groups: list[list[TrackedRollout]]
    new_carry_over_rollouts: list[TrackedRollout]
    wait_seconds: float = 0.0
    polls: int = 0
    filtered_groups: list[list[TrackedRollout]] = field(default_factory=list)  # complete, no signal


class NoSignal(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` batches' worth of groups in a row scored
    alike within each group: nothing left to learn from (all solved, or all failed)."""


def has_signal(scores: Sequence[float]) -> bool:
    """DAPO's dynamic-sampling rule: a group teaches something only when its members' scores
    differ (alike scores make every advantage 0)."""
    return len(set(scores)) > 1


@dataclass
class GroupFilter:
    """The zero-variance filter (`algorithm.filter_groups`): `scores` gives a complete group's
    member scores, `top_up` new prompts in place of a filtered group, and `max_filtered`
    bounds how many groups one wait may filter (None = no bound)."""

    scores: Callable[[list[TrackedRollout]], Awaitable[list[float]]]
    top_up: Callable[[int], list[Prompt]]
    max_filtered: int | None = None


def group_by_data_id(rollouts: Iterable[TrackedRollout]) -> dict[str, list[TrackedRollout]]:
    groups: dict[str, list[TrackedRollout]] = {}
    for rollout in rollouts:
        groups.setdefault(rollout.data_id, []).append(rollout)
    return groups


def new_group(prompt: Prompt, n: int, step: int) -> list[TrackedRollout]:
    group_tag = new_rollout_id()  # made in order, as the store's own ids are (see there)
    return [
        TrackedRollout(rollout_id=f"{group_tag}-{i}", data_id=prompt.data_id, input=prompt.input, enqueued_step=step)
        for i in range(n)
    ]


@dataclass
class AsyncRolloutManager:
    backend: RolloutBackend
    train_rollout_n: int
    completion_log: list[str] = field(default_factory=list)  # group keys in completion order
    on_poll: Callable[[WindowStatus], None] | None = None  # a live display of the window
    group_filter: GroupFilter | None = None  # zero-variance groups neither count nor train

    async def enqueue_and_wait_until_group_completed(
        self,
        new_prompts: Sequence[Prompt],
        carry_over_rollouts: Sequence[TrackedRollout],
        target_finished_group_num: int,
        step: int,
        is_train: bool = True,
    ) -> GroupedResult:
        new_rollouts = [r for prompt in new_prompts for r in new_group(prompt, self.train_rollout_n, step)]
        if new_rollouts:
            await self.backend.enqueue(new_rollouts, is_train)
        active_rollouts = [*carry_over_rollouts, *new_rollouts]
        groups = group_by_data_id(active_rollouts)
        for key, group in groups.items():
            assert len(group) == self.train_rollout_n, (
                f"group {key} has {len(group)} rollouts, expected actor_rollout_ref.rollout.n={self.train_rollout_n}"
            )
        if target_finished_group_num > len(groups):
            raise ValueError(
                f"waiting for {target_finished_group_num} complete groups but only {len(groups)} are active"
            )

        started = self.backend.now()
        completed_group_keys: list[str] = []
        filtered: dict[str, list[TrackedRollout]] = {}
        alike_scores: list[float] = []  # the one score of each filtered group
        polls = 0
        while True:
            pending = [r for r in active_rollouts if not r.state.terminal]
            if pending:
                updates = await self.backend.poll([r.rollout_id for r in pending])
                polls += 1
                for rollout in pending:
                    update = updates.get(rollout.rollout_id)
                    if update is not None:
                        _apply(rollout, update)
            # A group counts only when every sibling is terminal; keep completion order.
            for key, group in list(groups.items()):
                if key not in completed_group_keys and all(r.state.terminal for r in group):
                    alike = await self._alike_score(group)
                    if alike is not None:
                        filtered[key] = groups.pop(key)
                        alike_scores.append(alike)
                        active_rollouts = [r for r in active_rollouts if r.data_id != key]
                        replacements = await self._top_up(alike_scores, step, is_train)
                        active_rollouts += replacements
                        groups.update(group_by_data_id(replacements))
                    else:
                        completed_group_keys.append(key)
            if self.on_poll is not None:
                self.on_poll(
                    _window_status(active_rollouts, len(completed_group_keys), target_finished_group_num, step)
                )
            if len(completed_group_keys) >= target_finished_group_num:
                break
            await self.backend.wait()

        consumed = completed_group_keys[:target_finished_group_num]
        self.completion_log.extend(consumed)
        return GroupedResult(
            completed_groups=[groups[key] for key in consumed],
            new_carry_over_rollouts=[r for key, group in groups.items() if key not in consumed for r in group],
            wait_seconds=self.backend.now() - started,
            polls=polls,
            filtered_groups=list(filtered.values()),
        )

    async def _alike_score(self, group: list[TrackedRollout]) -> float | None:
        """The one score of a complete group the zero-variance filter takes out of the window
        (every member scored it), or None when the group has signal or no filter is on."""
        if self.group_filter is None:
            return None
        scores = await self.group_filter.scores(group)
        return None if has_signal(scores) else scores[0]

    async def _top_up(self, alike_scores: list[float], step: int, is_train: bool) -> list[TrackedRollout]:
        """A new group in place of a filtered one, unless this wait has filtered too many."""
        assert self.group_filter is not None
        bound = self.group_filter.max_filtered
        if bound is not None and len(alike_scores) >= bound:
            counts = ", ".join(f"{n} at {score:g}" for score, n in sorted(Counter(alike_scores).items()))
            raise NoSignal(
                f"{len(alike_scores)} complete groups of one step scored alike within each group ({counts}; "
                "algorithm.filter_groups.max_num_gen_batches x data.train_batch_size): "
                "no group with signal, the tasks are all solved or all failed at this policy"
            )
        rollouts = [r for prompt in self.group_filter.top_up(1) for r in new_group(prompt, self.train_rollout_n, step)]
        if rollouts:
            await self.backend.enqueue(rollouts, is_train)
        return rollouts


def _window_status(active: Sequence[TrackedRollout], completed: int, target: int, step: int) -> WindowStatus:
    carried = [r for r in active if r.enqueued_step < step]
    return WindowStatus(
        completed_groups=min(completed, target),
        target_groups=target,
        running=sum(r.state == RolloutState.RUNNING for r in active),
        queued=sum(r.state == RolloutState.QUEUING for r in active),
        carry_over=len(carried),
        oldest_carry_over_age=max((step - r.enqueued_step for r in carried), default=0),
    )


def _apply(rollout: TrackedRollout, update: RolloutUpdate) -> None:
    rollout.state = update.state
    rollout.created_at = update.created_at
    rollout.started_at = update.started_at
    rollout.finished_at = update.finished_at
    rollout.error_message = update.error_message


class GatewayBackend:
    """The real backend: rollouts in the gateway's store, polled every `poll_interval` seconds."""

    def __init__(self, client: Any, rollout_config: dict[str, Any] | None = None, poll_interval: float = 0.2) -> None:
        from rollover.gateway.client import GatewayClient

        self.client: GatewayClient = client
        self.rollout_config = rollout_config or {}
        self.poll_interval = poll_interval

    async def enqueue(self, rollouts: Sequence[TrackedRollout], is_train: bool) -> None:
        body = [
            {
                "rollout_id": r.rollout_id,
                "input": r.input,
                "is_train": is_train,
                "config": self.rollout_config,
                "metadata": {"data_id": r.data_id, "enqueued_step": r.enqueued_step},
            }
            for r in rollouts
        ]
        await self.client.enqueue(body)

    async def poll(self, rollout_ids: Sequence[str]) -> dict[str, RolloutUpdate]:
        found = await self.client.list_rollouts(rollout_ids=rollout_ids)
        return {
            r.rollout_id: RolloutUpdate(
                state=r.state,
                created_at=r.created_at,
                started_at=r.started_at,
                finished_at=r.finished_at,
                error_message=r.status.error_message,
            )
            for r in found
        }

    async def wait(self) -> None:
        await asyncio.sleep(self.poll_interval)

    async def abort(self, rollout_ids: Sequence[str], reason: str) -> None:
        from rollover.gateway.client import ConflictError, NotFoundError

        for rollout_id in rollout_ids:
            try:
                await self.client.update_status(rollout_id, state="failed", error_message=f"aborted: {reason}")
            except (ConflictError, NotFoundError):
                pass  # already terminal or gone: nothing to stop

    def now(self) -> float:
        return time.time()
