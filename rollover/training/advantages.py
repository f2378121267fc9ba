"""Advantages without a critic (verl's `compute_*_advantage`), as pure functions.

What is normalised is a *unit*: a rollout, or with several policies a rollout's share of one
policy (`Unit`), in its group (`GroupKey`: the prompt's group, and the policy). Its score is
its reward less the KL penalty when the KL is in the reward (`penalised_scores`).

- Outcome estimators give one advantage per unit (`outcome_advantages`): `grpo`, `rloo`,
  `opo`, `grpo_passk`, `gpg`, and `reinforce_plus_plus_baseline`'s centring;
- token estimators work on each sample's token rewards (the unit's reward at the sample's last
  trained token, less β·KL on every trained token): `reward_to_go`, `whiten`
  (`reinforce_plus_plus` and `reinforce_plus_plus_baseline` whiten over every trained token of
  the batch), `optimal_token_baseline`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rollover.config.algorithm import AdvEstimator

EPS = 1e-6  # verl's epsilon of the group statistics
WHITEN_EPS = 1e-8  # verl's `masked_whiten` variance floor
OTB_EPS = 1e-8  # verl's optimal-token-baseline denominator floor

# The estimators that give one advantage per unit (the others work token by token).
OUTCOME_ESTIMATORS: frozenset[AdvEstimator] = frozenset({"grpo", "rloo", "opo", "grpo_passk", "gpg"})


class Unit(NamedTuple):
    """What an advantage is computed for: a rollout, or its share of one policy."""

    rollout_id: str
    policy: str | None = None


class GroupKey(NamedTuple):
    """What a unit is normalised among: its prompt's group, or that group's units of one policy."""

    group_id: str
    policy: str | None = None


@dataclass(frozen=True)
class UnitScore:
    unit: Unit
    group: GroupKey
    score: float  # the reward, less the KL penalty when the KL is in the reward
    tokens: float = 0.0  # its trained tokens over all its samples (OPO's length)


def _groups(units: Sequence[UnitScore]) -> dict[GroupKey, list[int]]:
    members: dict[GroupKey, list[int]] = {}
    for index, unit in enumerate(units):
        members.setdefault(unit.group, []).append(index)
    return members


def outcome_advantages(
    units: Sequence[UnitScore], estimator: AdvEstimator, *, norm_by_std: bool = True, eps: float = EPS
) -> list[float]:
    """One advantage per unit, within each group (groups need not be contiguous); s = score,
    n the group's size, means and unbiased stds over the group:

    - `grpo`: `(s - mean) / (std + eps)`; with `norm_by_std` false (Dr. GRPO) `s - mean`;
    - `rloo`: `n/(n-1)·(s - mean)`: s minus the mean of the other n-1;
    - `opo`: `s - Σ len·s / Σ len`, the length-weighted mean (len: the unit's trained tokens);
    - `grpo_passk`: the group's best `(s_max - s_second) / (std + eps)` (no division without
      `norm_by_std`), every other member 0 (Pass@k, Chen et al. 2025);
    - `gpg`: `α·(s - mean)`, `α = N / #(s ≠ 0)` over all N units of the batch (GPG's rescale);
    - `reinforce_plus_plus_baseline`: `s - mean` (the caller then whitens it over tokens).

    A group of one has no baseline: grpo, rloo and opo give it `s`, gpg `α·s`, grpo_passk 0.
    """
    scores = torch.tensor([u.score for u in units], dtype=torch.float64)
    advantages = scores.clone()
    if estimator == "grpo_passk":
        advantages.zero_()
    alpha = len(units) / max(1, int(torch.count_nonzero(scores)))
    for indices in _groups(units).values():
        idx = torch.tensor(indices, dtype=torch.long)
        group = scores[idx]
        n = len(indices)
        if estimator == "gpg":
            advantages[idx] = alpha * (group - (group.mean() if n > 1 else 0.0))
            continue
        if n == 1:
            continue
        centred = group - group.mean()
        if estimator == "rloo":
            advantages[idx] = centred * (n / (n - 1))
        elif estimator == "opo":
            lengths = torch.tensor([units[i].tokens for i in indices], dtype=torch.float64)
            baseline = (lengths * group).sum() / lengths.sum() if lengths.sum() > 0 else group.mean()
            advantages[idx] = group - baseline
        elif estimator == "grpo_passk":
            best, second = torch.topk(group, 2).values
            value = best - second
            advantages[indices[int(torch.argmax(group))]] = value / (group.std() + eps) if norm_by_std else value
        elif estimator == "grpo" and norm_by_std:
            advantages[idx] = centred / (group.std(correction=1) + eps)
        elif estimator in ("grpo", "reinforce_plus_plus_baseline"):
            advantages[idx] = centred
        else:
            raise ValueError(f"{estimator} is not an outcome estimator")
    return advantages.tolist()


def penalised_scores(units: Sequence[tuple[Unit, float]], kl_sums: Mapping[Unit, float], coef: float) -> list[float]:
    """verl's KL in the reward: `s_u - β·Σ_t KL_t` over every trained token of unit u (its token
    rewards summed, as verl's outcome estimators read them); a unit with no samples keeps s."""
    return [reward - coef * kl_sums.get(unit, 0.0) for unit, reward in units]


def reward_to_go(token_rewards: torch.Tensor) -> torch.Tensor:
    """`G_t = Σ_{t' ≥ t} r_t'` along one sample's `[T]` token rewards (γ = 1, verl's default).

    verl resets the running return at every masked token; in a multi-turn sample that zeroes
    every turn before the last (a tool's output is masked). Here the return runs through the
    whole sample, so an earlier turn's tokens get the outcome too: a deliberate deviation.
    """
    return token_rewards.flip(-1).cumsum(-1).flip(-1)


def whiten(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """verl's `masked_whiten` over every masked token of every sample: `(x - μ)/sqrt(σ² + 1e-8)`,
    μ and the unbiased σ² over all of them together (each token weighs the same)."""
    flat = torch.cat([v[m.bool()] for v, m in zip(values, masks)]).double() if values else torch.zeros(0)
    if flat.numel() == 0:
        return [torch.zeros_like(v) for v in values]
    mean = flat.mean()
    variance = flat.var(correction=1) if flat.numel() > 1 else torch.zeros((), dtype=torch.float64)
    scale = torch.rsqrt(variance + WHITEN_EPS)
    return [((v.double() - mean) * scale).float() * m for v, m in zip(values, masks)]


def optimal_token_baseline(
    returns: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    groups: Sequence[GroupKey],
) -> list[torch.Tensor]:
    """The optimal token baseline (verl's `optimal_token_baseline`): per position t of a
    response, among the group's samples, `B_t = Σ_i G_i,t·W_i,t / (Σ_i W_i,t + 1e-8)` over the
    samples with a trained token at t, and `A_i,t = G_i,t - B_t` on trained tokens.

    `W_i,t = Σ_{j ≤ t} m_j·w_j` is the sample's path-variance so far, from `weights` `w_t = 1 -
    2π_t + Σ_v π(v)²` (π_old; times the squared IS weight when the rollout correction weighs
    tokens). Positions count from each sample's first trained token, as verl counts them from the
    response's start. A sample alone in its group keeps `A = G`.
    """
    cumulative = [(w * m).cumsum(-1) for w, m in zip(weights, masks)]
    starts = [int(m.nonzero()[0]) if bool(m.any()) else 0 for m in masks]
    advantages = [g * m for g, m in zip(returns, masks)]
    members: dict[GroupKey, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    for indices in members.values():
        if len(indices) < 2:
            continue
        width = max(len(masks[i]) - starts[i] for i in indices)
        numerator = torch.zeros(width, dtype=torch.float64)
        denominator = torch.zeros(width, dtype=torch.float64)
        for i in indices:
            m = masks[i][starts[i] :].double()
            numerator[: len(m)] += returns[i][starts[i] :].double() * cumulative[i][starts[i] :].double() * m
            denominator[: len(m)] += cumulative[i][starts[i] :].double() * m
        baseline = numerator / (denominator + OTB_EPS)
        for i in indices:
            length = len(masks[i]) - starts[i]
            aligned = torch.zeros_like(returns[i], dtype=torch.float64)
            aligned[starts[i] :] = baseline[:length]
            advantages[i] = ((returns[i].double() - aligned) * masks[i]).float()
    return advantages
