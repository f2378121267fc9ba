"""The mini-batch plan of one update, decided on rank 0 and followed by every rank: which
samples train (`agentlightning.max_ppo_update_times` may drop some), each optimizer step's
mini-batch (the shuffles of every PPO epoch), the learning rate and KL-in-reward coefficient.
A pure function of the batch, `PlanSettings` and the trainer's random generator."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollover.training.samples import RolloutScore, Sample, UpdateBatch
from rollover.training.update_settings import PlanSettings


@dataclass
class UpdatePlan:
    """One update: the samples, the rollouts they came from (advantages are computed in the
    update), the indices of each optimizer step's mini-batch, the learning rate, the
    KL-in-reward coefficient, the seed of the update's own random draws (clip_cov's choice:
    every rank draws alike) and what planning dropped, as metrics."""

    samples: list[Sample]
    rollouts: list[RolloutScore]
    steps: list[list[int]]
    lr: float
    kl_coef: float = 0.0
    seed: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def plan_update(
    batch: UpdateBatch, settings: PlanSettings, rng: random.Random, *, lr: float, kl_coef: float = 0.0
) -> UpdatePlan:
    """The samples with targets (capped by `max_ppo_update_times`) and each optimizer step's
    mini-batch; `rng` (the trainer's, checkpointed) shuffles each PPO epoch."""
    kept = [s for s in batch.samples if s.num_target_tokens > 0]
    no_policy = 0
    if settings.policies:  # a call no policy answered (e.g. before the adapters were served) trains none
        no_policy = sum(s.policy not in settings.policies for s in kept)
        kept = [s for s in kept if s.policy in settings.policies]
    mini = mini_batch_samples(settings, len(kept))
    kept, dropped = cap_update_times(kept, batch.rollouts, mini, settings.max_ppo_update_times, rng)
    if settings.policies:
        dropped["training/n_sample_dropped/no_policy"] = float(no_policy)
    steps: list[list[int]] = []
    for _ in range(settings.ppo_epochs):
        order = list(range(len(kept)))
        rng.shuffle(order)
        # Several policies: each mini-batch is one policy's (each step moves one adapter).
        parts = [[i for i in order if kept[i].policy == name] for name in settings.policies] or [order]
        steps += [part[start : start + mini] for part in parts for start in range(0, len(part), mini)]
    return UpdatePlan(kept, list(batch.rollouts), steps, lr, kl_coef, rng.getrandbits(31), dropped)


def mini_batch_samples(settings: PlanSettings, n_samples: int) -> int:
    """Samples per optimizer step: `ppo_mini_batch_size` counts prompts, as in verl, each with
    `rollout.n` samples (the whole batch when null)."""
    prompts = settings.mini_batch_prompts
    return max(1, n_samples if prompts is None else prompts * settings.rollout_n)


def cap_update_times(
    samples: list[Sample], rollouts: Sequence[RolloutScore], mini: int, cap: int | None, rng: random.Random
) -> tuple[list[Sample], dict[str, float]]:
    """Agent Lightning's `max_ppo_update_times`: at most `cap` mini-batches per epoch; the
    samples beyond are dropped, those of groups whose rewards are all alike (no signal) first,
    then at random."""
    n_drop = 0 if cap is None else max(0, len(samples) - mini * cap)
    metrics = {"training/n_sample_dropped/same_reward": 0.0, "training/n_sample_dropped/random": 0.0}
    if n_drop == 0:
        return samples, metrics
    rewards: dict[str, set[float]] = {}
    for rollout in rollouts:
        rewards.setdefault(rollout.group_id, set()).add(rollout.reward)
    alike = [i for i, s in enumerate(samples) if len(rewards.get(s.group_id, ())) <= 1]
    rng.shuffle(alike)
    drop = set(alike[:n_drop])
    others = [i for i in range(len(samples)) if i not in drop]
    rng.shuffle(others)
    n_random = n_drop - len(drop)
    drop.update(others[:n_random])
    metrics["training/n_sample_dropped/same_reward"] = float(n_drop - n_random)
    metrics["training/n_sample_dropped/random"] = float(n_random)
    return [s for i, s in enumerate(samples) if i not in drop], metrics
