"""Rollout correction: the sampler μ (the inference engine) is not π_old (verl's
``algorithm.rollout_correction``, docs/algo/rollout_corr.md).

Two remedies, both from the per-token log-ratio ``ρ_t = log π_old - log μ`` on masked tokens:

- ``importance_weights``: truncated IS weights ``min(π_old/μ, C)`` that multiply the loss;
- ``rejection_mask``: drop tokens or whole sequences whose ratio is outside ``[lower, upper]``,
  and (veto) whole sequences holding a token μ made far likelier than π_old would.

Both are detached (they reweight or select, they are not optimised) and are meant to be called
once on the whole batch: the metrics of micro-batches do not average into the batch's.
``behaviour_logprobs`` must be finite on masked tokens (NaN there, a response recorded without
logprobs, would poison them); off the mask anything goes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollover.config.algorithm import RejectionMode, RolloutIsMode
from rollover.training.loss.masked import LOG_RATIO_BOUND, masked_mean, on_mask, valid_mask


@dataclass(frozen=True)
class RatioStatistic:
    """One ratio per unit (token ``[B, T]`` or sequence ``[B]``) and which units count."""

    values: torch.Tensor
    valid: torch.Tensor


StatisticFn = Callable[[torch.Tensor, torch.Tensor], RatioStatistic]


def log_ratio(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``ρ = log π_old - log μ`` in float32, detached, 0 off the mask."""
    return on_mask(old_logprobs.detach(), valid) - on_mask(behaviour_logprobs.detach(), valid)


def token_ratios(rho: torch.Tensor, valid: torch.Tensor) -> RatioStatistic:
    """Per token: ``exp(clamp(ρ_t, -20, 20))``, over masked tokens."""
    return RatioStatistic(torch.exp(rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), valid)


def sequence_ratios(rho: torch.Tensor, valid: torch.Tensor) -> RatioStatistic:
    """Per row: ``exp(clamp(Σ_t m_t ρ_t, -20, 20))`` = π_old(y)/μ(y), over rows with a masked token."""
    return RatioStatistic(torch.exp(rho.sum(dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), valid.any(dim=-1))


def geometric_ratios(rho: torch.Tensor, valid: torch.Tensor) -> RatioStatistic:
    """Per row: ``exp(clamp(Σ_t m_t ρ_t / Σ_t m_t, ±20))``, the geometric mean of the token ratios."""
    mean_rho = rho.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
    return RatioStatistic(torch.exp(mean_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), valid.any(dim=-1))


IS_STATISTICS: dict[RolloutIsMode, StatisticFn] = {
    "token": token_ratios,
    "sequence": sequence_ratios,
}

REJECTION_STATISTICS: dict[RejectionMode, StatisticFn] = {
    "token": token_ratios,
    "sequence": sequence_ratios,
    "geometric": geometric_ratios,
}


def _per_row_as_column(unit_values: torch.Tensor) -> torch.Tensor:
    """A per-row ``[B]`` tensor as ``[B, 1]`` (broadcasts over tokens); a per-token ``[B, T]`` as is."""
    return unit_values.unsqueeze(-1) if unit_values.dim() == 1 else unit_values


def _on_tokens(flags: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bool ``flags`` per token ``[B, T]`` or per row ``[B]``, as ``[B, T]`` on masked tokens only."""
    return _per_row_as_column(flags) & valid


def _summary(statistic: RatioStatistic) -> tuple[float, float, float]:
    """``(mean, max, min)`` of the statistic over its valid units; zeros when there are none."""
    if not bool(statistic.valid.any()):
        return 0.0, 0.0, 0.0
    chosen = statistic.values[statistic.valid]
    return chosen.mean().item(), chosen.max().item(), chosen.min().item()


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: RolloutIsMode,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``π_old / μ`` (verl's ``rollout_is``, threshold C).

    - ``token``: ``w_t = min(exp(clamp(ρ_t, ±20)), C)``.
    - ``sequence``: ``w = min(exp(clamp(Σ_t m_t ρ_t, ±20)), C)``, one weight per row broadcast
      over its tokens.

    The weights are detached and 0 off the mask. Metrics, as verl reports them, over masked
    tokens (token mode) or rows with a masked token (sequence mode), of the weights *before*
    truncation (so ``is_max`` shows how far μ is, not C): ``rollout_corr/is_mean``, ``is_max``,
    ``clipped_fraction`` (share above C); under verl's names ``rollout_is_mean``,
    ``rollout_is_max``, ``rollout_is_min``, ``rollout_is_ratio_fraction_high`` (= clipped_fraction)
    and ``rollout_is_ratio_fraction_low`` (share below 1/C); and ``rollout_corr/kl``, the k1
    estimate of KL(μ || π_old): the mean over masked tokens of ``log μ - log π_old``, unbiased
    because the tokens were sampled from μ.
    """
    if mode not in IS_STATISTICS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be null, 'token' or 'sequence', got {mode!r}")
    valid = valid_mask(mask)
    rho = log_ratio(old_logprobs, behaviour_logprobs, valid)
    statistic = IS_STATISTICS[mode](rho, valid)
    unit_weights = _per_row_as_column(statistic.values.clamp(max=threshold))
    weights = torch.where(valid, unit_weights, torch.zeros((), device=rho.device))

    is_mean, is_max, is_min = _summary(statistic)
    fraction_high = masked_mean((statistic.values > threshold).float(), statistic.valid).item()
    fraction_low = masked_mean((statistic.values < 1.0 / threshold).float(), statistic.valid).item()
    metrics = {
        "rollout_corr/is_mean": is_mean,
        "rollout_corr/is_max": is_max,
        "rollout_corr/clipped_fraction": fraction_high,
        "rollout_corr/kl": masked_mean(-rho, valid).item(),
        "rollout_corr/rollout_is_mean": is_mean,
        "rollout_corr/rollout_is_max": is_max,
        "rollout_corr/rollout_is_min": is_min,
        "rollout_corr/rollout_is_ratio_fraction_high": fraction_high,
        "rollout_corr/rollout_is_ratio_fraction_low": fraction_low,
    }
    return weights.detach(), metrics


def vetoed_rows(rho: torch.Tensor, valid: torch.Tensor, veto: float) -> torch.Tensor:
    """``[B]`` bool: rows holding a masked token with ``exp(ρ_t) < veto`` (unclamped ratio).

    Compared in log space, ``ρ_t < log(veto)``, so no ratio overflows or underflows.
    """
    return ((rho < math.log(veto)) & valid).any(dim=-1)


def rejection_mask(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: RejectionMode,
    upper: float,
    lower: float | None,
    veto: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Which masked tokens to keep (verl's ``rollout_rs``): ``[B, T]`` float 0/1, already times the mask.

    With ``ρ_t = log π_old - log μ`` on masked tokens and ``lower = 1/upper`` when None:

    - ``token``: drop token t if ``exp(ρ_t)`` is outside ``[lower, upper]``;
    - ``sequence``: drop the row if ``exp(clamp(Σ_t ρ_t, ±20))`` is outside ``[lower, upper]``;
    - ``geometric``: drop the row if ``exp(mean_t ρ_t)`` is outside ``[lower, upper]``;
    - ``veto`` (verl's ``rollout_token_veto_threshold``): also drop the row if any token has
      ``exp(ρ_t) < veto``.

    Metrics, under verl's names: ``rollout_corr/rollout_rs_masked_fraction`` (share of masked
    tokens dropped), ``rollout_rs_seq_masked_fraction`` (share of rows with a masked token that
    lost any), ``rollout_rs_mean`` / ``_max`` / ``_min`` of the statistic compared (token ratios,
    sequence ratios or geometric means) over its units, and with ``veto``
    ``rollout_is_veto_fraction`` (share of rows with a masked token that were vetoed).
    """
    if mode not in REJECTION_STATISTICS:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs must be null or one of {list(REJECTION_STATISTICS)}, got {mode!r}"
        )
    low = 1.0 / upper if lower is None else lower
    if not 0.0 < low <= upper:
        raise ValueError(f"rejection bounds must satisfy 0 < lower <= upper, got lower={low}, upper={upper}")
    if veto is not None and veto <= 0.0:
        raise ValueError(f"rollout_token_veto_threshold must be > 0, got {veto}")
    valid = valid_mask(mask)
    rho = log_ratio(old_logprobs, behaviour_logprobs, valid)
    statistic = REJECTION_STATISTICS[mode](rho, valid)
    outside = (statistic.values > upper) | (statistic.values < low)
    rejected = _on_tokens(outside, valid)
    rows = valid.any(dim=-1)
    metrics: dict[str, float] = {}
    if veto is not None:
        vetoed = vetoed_rows(rho, valid, veto)
        rejected = rejected | _on_tokens(vetoed, valid)
        metrics["rollout_corr/rollout_is_veto_fraction"] = masked_mean(vetoed.float(), rows).item()
    keep = valid & ~rejected

    rs_mean, rs_max, rs_min = _summary(statistic)
    metrics |= {
        "rollout_corr/rollout_rs_masked_fraction": masked_mean(rejected.float(), valid).item(),
        "rollout_corr/rollout_rs_seq_masked_fraction": masked_mean(rejected.any(dim=-1).float(), rows).item(),
        "rollout_corr/rollout_rs_mean": rs_mean,
        "rollout_corr/rollout_rs_max": rs_max,
        "rollout_corr/rollout_rs_min": rs_min,
    }
    return keep.float(), metrics
