"""The learning-rate schedule as pure functions of the update step (verl's ``optim`` keys).

``lr_warmup_steps`` / ``lr_warmup_steps_ratio`` give the warmup (``warmup_steps``);
``lr_scheduler_type`` is a ``ScheduleKind``; ``min_lr_ratio`` and ``num_cycles`` shape the cosine.
``lr_factor`` is the multiplier of the base lr at a 0-based update step, as in verl (and
Hugging Face's ``get_*_schedule_with_warmup``): step 0 of a warmup has factor 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rollover.config.actor_rollout_ref import ScheduleKind


@dataclass(frozen=True)
class Schedule:
    """The shape of one run's schedule: ``warmup`` and ``total`` update steps, and the cosine's
    floor ``min_lr_ratio`` and ``num_cycles`` (0.5 = one half-period, from 1 down to the floor)."""

    warmup: int
    total: int
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


ScheduleFn = Callable[[int, Schedule], float]


def warmup_steps(lr_warmup_steps: int, ratio: float, total_steps: int) -> int:
    """``lr_warmup_steps`` when > 0, else ``int(ratio · total_steps)``."""
    return lr_warmup_steps if lr_warmup_steps > 0 else int(ratio * total_steps)


def warmup_factor(step: int, schedule: Schedule) -> float:
    """``step / max(1, warmup)``: the linear ramp from 0 (verl's ``init_lr_ratio`` 0)."""
    return step / max(1, schedule.warmup)


def constant_factor(step: int, schedule: Schedule) -> float:
    """The warmup ramp, then 1."""
    return warmup_factor(step, schedule) if step < schedule.warmup else 1.0


def cosine_factor(step: int, schedule: Schedule) -> float:
    """The warmup ramp, then ``max(m, ½(1 + m) + ½(1 - m)·cos(2π·num_cycles·p))``.

    ``m = min_lr_ratio`` and ``p = (step - warmup) / max(1, total - warmup)`` the progress after
    warmup; with ``num_cycles = 0.5`` the factor falls from 1 at ``p = 0`` to ``m`` at ``p = 1``.
    """
    if step < schedule.warmup:
        return warmup_factor(step, schedule)
    progress = (step - schedule.warmup) / max(1, schedule.total - schedule.warmup)
    floor = schedule.min_lr_ratio
    cosine = math.cos(2.0 * math.pi * schedule.num_cycles * progress)
    return max(floor, 0.5 * (1.0 + floor) + 0.5 * (1.0 - floor) * cosine)


SCHEDULES: dict[ScheduleKind, ScheduleFn] = {
    "constant": constant_factor,
    "cosine": cosine_factor,
}


def lr_factor(
    step: int,
    *,
    warmup: int,
    total: int,
    kind: ScheduleKind,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """The multiplier of the base lr at 0-based update ``step`` under ``kind`` (see ``SCHEDULES``)."""
    if kind not in SCHEDULES:
        raise ValueError(
            f"actor_rollout_ref.actor.optim.lr_scheduler_type must be one of {list(SCHEDULES)}, got {kind!r}"
        )
    return SCHEDULES[kind](step, Schedule(warmup, total, min_lr_ratio, num_cycles))
