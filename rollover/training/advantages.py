"""Advantages of outcome rewards within prompt groups (verl's GRPO, Dr. GRPO and RLOO), and
the KL penalty verl subtracts from the reward first (`algorithm.use_kl_in_reward`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

import torch

from rollover.config.algorithm import AdvEstimator
from rollover.training.samples import RolloutScore


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    estimator: AdvEstimator,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per rollout, normalised within each group of ``group_ids``.

    - ``grpo``: ``(s - mean_g) / (std_g + eps)`` with the unbiased std; with ``norm_by_std``
      false (``algorithm.norm_adv_by_std_in_grpo``) ``s - mean_g``: Dr. GRPO.
    - ``rloo``: ``n / (n - 1) * (s - mean_g)``, i.e. ``s`` minus the mean of the other n-1.

    A group of one has no baseline (and no std), so both estimators return the raw reward
    ``A = s`` for it rather than NaN or 0. Groups need not be contiguous.
    """
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"algorithm.adv_estimator must be 'grpo' or 'rloo', got {estimator!r}")
    if rewards.dim() != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(
            f"rewards must be 1-D with one entry per group id; got shape "
            f"{tuple(rewards.shape)} for {len(group_ids)} group ids"
        )
    scores = rewards.detach().to(torch.float64)
    advantages = scores.clone()

    members: dict[str, list[int]] = {}
    for index, group_id in enumerate(group_ids):
        members.setdefault(group_id, []).append(index)

    for indices in members.values():
        n = len(indices)
        if n == 1:
            continue
        idx = torch.tensor(indices, dtype=torch.long)
        group = scores[idx]
        centred = group - group.mean()
        if estimator == "rloo":
            advantages[idx] = centred * (n / (n - 1))
        elif norm_by_std:
            advantages[idx] = centred / (group.std(correction=1) + eps)
        else:
            advantages[idx] = centred

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return advantages.to(out_dtype)


def penalised_scores(rollouts: Sequence[RolloutScore], kl_sums: Mapping[str, float], coef: float) -> list[float]:
    """verl's KL in the reward: ``s_i - β · Σ_t KL_t`` over every trained token of rollout ``i``
    (its token-level rewards summed, as verl's outcome estimators read them); a rollout with no
    samples keeps its reward."""
    return [r.reward - coef * kl_sums.get(r.rollout_id, 0.0) for r in rollouts]


def policy_unit(rollout_id: str, policy: str | None) -> str:
    """A rollout's share of one policy, as advantages and per-rollout divisors count it."""
    return f"{rollout_id}\x00{policy}"


def policy_units(
    rollouts: Sequence[RolloutScore], policies: Sequence[str], present: Set[tuple[str, str | None]]
) -> list[RolloutScore]:
    """Several policies: each (rollout, policy) in `present` (it has samples of that policy) as
    a rollout of its own in the group (group, policy), with the rollout's reward, so each
    policy's advantages are normalised among its own rollouts."""
    return [
        RolloutScore(policy_unit(r.rollout_id, name), policy_unit(r.group_id, name), r.reward)
        for r in rollouts
        for name in policies
        if (r.rollout_id, name) in present
    ]
