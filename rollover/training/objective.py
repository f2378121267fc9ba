"""The loss of one micro-batch: a pure function of its forward pass, its prepared rows, the
mini-batch's counts and `UpdateSettings` (which holds the one resolved `LossChoice`).

`loss = pg - entropy_coeff·entropy + kl_loss_coef·KL(π_θ ‖ π_ref)`, each term this micro-batch's
share of the whole mini-batch's (`aggregate` divides by the mini-batch's counts, over all its
micro-batches on all ranks; per_rollout_mean by the batch's row divisors), so the shares summed
over micro-batches and ranks are the mini-batch's loss and any split takes the same step.

In bypass mode μ serves as π_old, and the rollout correction is taken here, per micro-batch,
against π_θ (as verl's bypass loss takes it): rejection, and for REINFORCE the IS weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rollover.training.loss.aggregate import BatchCounts, aggregate, per_rollout_mean
from rollover.training.loss.correction import importance_weights, rejection_mask
from rollover.training.loss.kl import kl_estimate
from rollover.training.loss.masked import on_mask
from rollover.training.loss.pg import PG_LOSSES, PgInputs
from rollover.training.prepare import PreparedSample
from rollover.training.samples import pad_rows
from rollover.training.update_settings import UpdateSettings


@dataclass(frozen=True)
class Forward:
    """One micro-batch's forward pass: `[B, T]` target-aligned `log π_θ` (with gradient) and
    the entropy of each next-token distribution."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


@dataclass
class Objective:
    """A micro-batch's loss, and its metrics: `means` as `(Σ value, count)` pairs (summed over
    micro-batches and ranks, then divided), `shares` this micro-batch's share of a mini-batch
    value (summed)."""

    loss: torch.Tensor
    means: dict[str, tuple[float, float]] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)


@dataclass
class MetricTotals:
    """The micro-batches' metrics of one optimizer step, added up on a rank and then over the
    ranks (`merged`): the means' sums and counts, and the shares' sums."""

    sums: dict[str, list[float]] = field(default_factory=dict)  # key -> [Σ value, count]
    shares: dict[str, float] = field(default_factory=dict)

    def add(self, objective: Objective) -> None:
        for key, (total, count) in objective.means.items():
            into = self.sums.setdefault(key, [0.0, 0.0])
            into[0] += total
            into[1] += count
        for key, value in objective.shares.items():
            self.shares[key] = self.shares.get(key, 0.0) + value

    @classmethod
    def merged(cls, parts: Sequence[MetricTotals]) -> MetricTotals:
        total = cls()
        for part in parts:
            total.add(Objective(torch.zeros(()), {k: (v[0], v[1]) for k, v in part.sums.items()}, part.shares))
        return total

    def values(self) -> dict[str, float]:
        return {key: total / max(count, 1.0) for key, (total, count) in self.sums.items()} | dict(self.shares)


def _mean(values: torch.Tensor, on: torch.Tensor) -> tuple[float, float]:
    return float(on_mask(values.detach(), on).sum()), float(on.sum())


def micro_batch_objective(
    forward: Forward,
    rows: Sequence[PreparedSample],
    counts: BatchCounts,
    settings: UpdateSettings,
    selected: torch.Tensor | None = None,
) -> Objective:
    """The loss of one micro-batch of `rows` (see the module's docstring); `selected` marks the
    tokens clip_cov cuts or kl_cov penalises (`loss.covariance`)."""
    logprobs = forward.logprobs
    device, width = logprobs.device, logprobs.shape[1]
    loss_mask = pad_rows([r.trained for r in rows], width, device=device)
    old = pad_rows([r.old for r in rows], width, device=device)
    advantages = pad_rows([r.advantages for r in rows], width, device=device)
    correction = settings.correction
    trained = loss_mask
    is_weights: torch.Tensor | None = None
    means: dict[str, tuple[float, float]] = {}
    if correction.bypass:
        # μ serves as π_old; a call recorded without logprobs is taken as on-policy.
        old = torch.where(torch.isnan(old), logprobs.detach(), old)
        current = logprobs.detach()
        if correction.rejection:
            trained, _ = rejection_mask(current, old, loss_mask, correction.rejection, correction.veto)
            means["rollout_corr/rollout_rs_masked_fraction"] = _mean(loss_mask - trained, loss_mask > 0)
        if settings.loss.pg_loss == "reinforce" and correction.is_mode is not None:
            is_weights, _ = importance_weights(current, old, loss_mask, correction.is_mode, correction.is_threshold)
        means["rollout_corr/kl"] = _mean(old - current, loss_mask > 0)
    elif rows[0].is_weights is not None:
        is_weights = pad_rows([r.is_weights for r in rows if r.is_weights is not None], width, device=device)
    terms = PG_LOSSES[settings.loss.pg_loss](
        PgInputs(logprobs, old, advantages, trained, is_weights, selected), settings.clip, settings.parameters
    )
    if settings.loss.pg_aggregation == "per_rollout_mean":
        pg_loss = per_rollout_mean(terms.per_token, trained, [r.divisor for r in rows])
    else:
        pg_loss = aggregate(terms.per_token, trained, settings.loss.pg_aggregation, counts)
    loss = pg_loss
    shares = {"actor/pg_loss": float(pg_loss.detach())}
    term_aggregation = settings.loss.term_aggregation
    if settings.entropy_coeff > 0:
        loss = loss - settings.entropy_coeff * aggregate(forward.entropy, trained, term_aggregation, counts)
    if settings.kl_loss_coef is not None:
        ref = pad_rows([r.ref for r in rows if r.ref is not None], width, device=device)
        kl = aggregate(
            kl_estimate(logprobs, ref, settings.kl_loss_type, mask=trained), trained, term_aggregation, counts
        )
        loss = loss + settings.kl_loss_coef * kl
        shares["actor/kl_loss"] = float(kl.detach())
    on = trained > 0
    means |= {
        "actor/pg_clipfrac": _mean(terms.clipped, on),
        "actor/pg_clipfrac_lower": _mean(terms.clipped_lower, on),
        "actor/ppo_kl": _mean(terms.kl, on),
        "actor/entropy": _mean(forward.entropy, on),
    }
    return Objective(loss, means, shares)
