"""The ideal speed-up: the most an async window can gain over synchronous rollout for a
duration distribution, a closed form estimated by Monte Carlo (no trainer involved)."""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from rollover.simulate.distributions import Distribution, Empirical


class IdealSteps(NamedTuple):
    sync_seconds: float  # expected synchronous step
    async_seconds: float  # ideal asynchronous step

    @property
    def speedup(self) -> float:
        return self.sync_seconds / self.async_seconds


def ideal_step_seconds(
    durations: Distribution | Sequence[float],
    batch_groups: int,
    n: int,
    update_seconds: float,
    capacity: int | None = None,
    pause_freezes_rollouts: bool = True,
    trials: int = 2000,
    seed: int = 0,
) -> IdealSteps:
    """The most an async window can gain over synchronous rollout for this distribution:
    the expected synchronous step, the ideal asynchronous one, and their ratio (`speedup`).

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
    return IdealSteps(sync_step, async_step)


def _fifo_makespan(durations: list[float], agents: int) -> float:
    if agents >= len(durations):
        return max(durations)
    free_at = [0.0] * agents
    for duration in durations:
        heapq.heappush(free_at, heapq.heappop(free_at) + duration)
    return max(free_at)
