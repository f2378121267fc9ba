"""What a running step is doing, as events for a live display (the console, or nothing).

The trainer, the rollout window and the policy update call a `Progress`; the default
`NullProgress` does nothing, so a trainer built without a display (tests, `rollover simulate`)
behaves exactly as before. Calls may come from the update's worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WindowStatus:
    """The active window after one poll. Counts are rollouts unless named groups."""

    completed_groups: int
    target_groups: int
    running: int
    queued: int
    carry_over: int  # rollouts in the window enqueued in an earlier step
    oldest_carry_over_age: int  # steps since the oldest of them was enqueued (0: none)


class Progress(Protocol):
    def step_started(self, step: int, total_steps: int) -> None:
        """`step` counts from 1, as the step's metrics are logged."""

    def rollout_wait(self, window: WindowStatus) -> None: ...

    def drain(self, inflight: int) -> None: ...

    def update(self, done: int, total: int) -> None:
        """Optimizer steps done of `total` in this update (`total` 0: not known yet)."""

    def weight_sync(self) -> None: ...

    def evaluation(self, done: int, total: int) -> None:
        """Held-out tasks finished of `total`."""

    def step_finished(self, step: int, metrics: Mapping[str, float]) -> None: ...


class NullProgress:
    def step_started(self, step: int, total_steps: int) -> None:
        pass

    def rollout_wait(self, window: WindowStatus) -> None:
        pass

    def drain(self, inflight: int) -> None:
        pass

    def update(self, done: int, total: int) -> None:
        pass

    def weight_sync(self) -> None:
        pass

    def evaluation(self, done: int, total: int) -> None:
        pass

    def step_finished(self, step: int, metrics: Mapping[str, float]) -> None:
        pass
