"""Rollout correction: the sampler μ (the inference engine) is not π_old (verl's
`algorithm.rollout_correction`, `verl/trainer/ppo/rollout_corr_helper.py`).

Two remedies, both from the per-token log-ratio `ρ_t = log π_old - log μ` on masked tokens:

- `importance_weights`: truncated IS weights `min(π_old/μ, C)` that multiply the loss;
- `rejection_mask`: drop tokens or whole sequences whose statistic leaves its bounds, in
  verl's spellings before 2026 (`token`, `sequence`, `geometric`: the ratio within
  `[lower, upper]`, and the veto) and verl HEAD's (`token_k1`, `seq_sum_k2`, ...: a divergence
  estimator of each token, or a sequence's sum, mean or max of it, every listed test passing).

Both take the mask *before* rejection, as verl's do: the IS weights of a sequence count all its
tokens, whatever rejection keeps. Both are detached and meant to be called once on the whole
batch (the metrics of micro-batches do not average into the batch's). `behaviour_logprobs` must
be finite on masked tokens; off the mask anything goes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rollover.config.algorithm import RejectionCriterion, RolloutIsMode
from rollover.training.loss.masked import LOG_RATIO_BOUND, masked_mean, on_mask, valid_mask

IS_MODES: tuple[RolloutIsMode, ...] = ("token", "sequence")


def log_ratio(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`ρ = log π_old - log μ` in float32, detached, 0 off the mask."""
    return on_mask(old_logprobs.detach(), valid) - on_mask(behaviour_logprobs.detach(), valid)


def _rows(values: torch.Tensor) -> torch.Tensor:
    """A per-row `[B]` tensor as `[B, 1]` (broadcasts over tokens); a per-token `[B, T]` as is."""
    return values.unsqueeze(-1) if values.dim() == 1 else values


def _token_mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean over the masked tokens of a per-token `[B, T]` or per-row `[B]` value: a row weighs
    its masked tokens (verl's `masked_mean` of the value broadcast over the sequence)."""
    return masked_mean(_rows(values).expand_as(valid), valid).item()


def _extremes(values: torch.Tensor, units: torch.Tensor) -> tuple[float, float]:
    if not bool(units.any()):
        return 0.0, 0.0
    chosen = values[units]
    return chosen.max().item(), chosen.min().item()


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: RolloutIsMode,
    threshold: float,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights `π_old / μ` (verl's `rollout_is`, threshold C), over `mask`
    (the tokens before any rejection).

    - `token`: `w_t = min(exp(clamp(ρ_t, ±20)), C)`.
    - `sequence`: `w = min(exp(clamp(Σ_t m_t ρ_t, ±20)), C)`, one weight per row over its tokens.
    - `batch_normalize` (verl's `rollout_is_batch_normalize`): the truncated weights divided by
      their mean, over the tokens (token) or over the sequences, one weight each (sequence).

    The weights are detached and 0 off the mask. Metrics, as verl reports them, of the weights
    before truncation (so `is_max` shows how far μ is, not C): `rollout_corr/is_mean` and
    `rollout_is_mean` (the mean over masked tokens: in sequence mode each sequence weighs its
    tokens), `is_max`/`rollout_is_max`, `rollout_is_min` (over tokens, or sequences),
    `clipped_fraction`/`rollout_is_ratio_fraction_high` (share above C) and
    `rollout_is_ratio_fraction_low` (below 1/C), both over tokens or sequences;
    `rollout_is_batch_norm_factor` when normalising; and `rollout_corr/kl`, the k1 estimate of
    KL(μ ‖ π_old): the mean over masked tokens of `log μ - log π_old`.
    """
    if mode not in IS_MODES:
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be null, 'token' or 'sequence', got {mode!r}")
    valid = valid_mask(mask)
    rows = valid.any(dim=-1)
    rho = log_ratio(old_logprobs, behaviour_logprobs, valid)
    if mode == "token":
        raw, units = torch.exp(rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), valid
    else:
        raw, units = torch.exp(rho.sum(dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), rows
    truncated = raw.clamp(max=threshold)
    weights = torch.where(valid, _rows(truncated), torch.zeros((), device=rho.device))
    is_max, is_min = _extremes(raw, units)
    high = masked_mean((raw > threshold).float(), units).item()
    metrics = {
        "rollout_corr/is_mean": _token_mean(raw, valid),
        "rollout_corr/is_max": is_max,
        "rollout_corr/clipped_fraction": high,
        "rollout_corr/kl": masked_mean(-rho, valid).item(),
        "rollout_corr/rollout_is_mean": _token_mean(raw, valid),
        "rollout_corr/rollout_is_max": is_max,
        "rollout_corr/rollout_is_min": is_min,
        "rollout_corr/rollout_is_ratio_fraction_high": high,
        "rollout_corr/rollout_is_ratio_fraction_low": masked_mean((raw < 1.0 / threshold).float(), units).item(),
    }
    if batch_normalize:
        # verl: the mean of the truncated weights over tokens, or over sequences (each one weight).
        mean = masked_mean(weights, valid) if mode == "token" else masked_mean(truncated, rows)
        if mean.item() > 1e-8:
            weights = weights / mean
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean.item() if mean.item() > 1e-8 else 1.0
    return weights.detach(), metrics


# ---------------------------------------------------------------- rejection


def _legacy_statistic(option: str, rho: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """verl's ratio before 2026: per token `exp(clamp(ρ_t, ±20))`; per row `exp(clamp(Σ_t ρ_t,
    ±20))` (sequence) or `exp(clamp(mean_t ρ_t, ±20))` (geometric): the clamp after the sum."""
    if option == "token":
        return torch.exp(rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    total = rho.sum(dim=-1)
    if option == "geometric":
        total = total / valid.sum(dim=-1).clamp(min=1)
    return torch.exp(total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def _head_statistic(option: str, rho: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """verl HEAD's statistic of `option`: of each token's clamped log-ratio `x = clamp(ρ_t, ±20)`
    (the clamp before any sum), `k1 = -x`, `k2 = x²/2` or `k3 = eˣ - 1 - x`, per token or a row's
    sum, mean or max of it over its masked tokens (a row with none: 0)."""
    x = rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    estimator = option.rsplit("_", 1)[1]
    token = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.exp(x) - 1.0 - x}[estimator]
    token = on_mask(token, valid)
    if option.startswith("token_"):
        return token
    if option.startswith("seq_sum_"):
        return token.sum(dim=-1)
    if option.startswith("seq_mean_"):
        return token.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
    largest = torch.where(valid, token, torch.full((), -math.inf, device=token.device)).max(dim=-1).values
    return torch.where(valid.any(dim=-1), largest, torch.zeros_like(largest))


def _criterion_test(
    criterion: RejectionCriterion, rho: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, float | None]:
    """`(statistic, kept per unit, upper, lower)` of one test; bounds in the statistic's units
    (HEAD's k1 compares `-log r` with the log of its bounds)."""
    legacy = criterion.option in ("token", "sequence", "geometric")
    statistic = (_legacy_statistic if legacy else _head_statistic)(criterion.option, rho, valid)
    upper, lower = criterion.upper, criterion.lower
    if not legacy and criterion.option.endswith("k1"):
        upper, lower = math.log(upper), math.log(lower) if lower is not None else None
    kept = statistic <= upper
    if lower is not None:
        kept = kept & (statistic >= lower)
    return statistic, kept, upper, lower


def rejection_mask(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    criteria: Sequence[RejectionCriterion],
    veto: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Which masked tokens to keep (verl's `rollout_rs`): `[B, T]` float 0/1, already times the mask.

    With `ρ_t = log π_old - log μ` on masked tokens, each criterion tests tokens or rows:

    - before 2026: `token` drops token t if `exp(ρ_t)` leaves `[lower, upper]`; `sequence` the
      row if `exp(clamp(Σ_t ρ_t, ±20))` does; `geometric` the row if `exp(clamp(mean_t ρ_t, ±20))`
      does; `veto` (`rollout_token_veto_threshold`) also drops a row holding a token with
      `exp(ρ_t) < veto` (unclamped);
    - verl HEAD: `token_k1` keeps a token whose `-clamp(ρ_t, ±20)` lies in `[log lower, log
      upper]`, `token_k2`/`k3` one whose k2/k3 is at most `upper`; `seq_sum_*`, `seq_mean_*`,
      `seq_max_*` keep a row by the sum, mean or max of its tokens' estimator. All must pass.

    Metrics, under verl's names: `rollout_corr/rollout_rs_masked_fraction` (share of masked
    tokens the criteria drop) and `rollout_rs_seq_masked_fraction` (share of rows that lost any),
    both before the veto, as verl reports them; before 2026 `rollout_rs_mean` (the statistic's
    mean over masked tokens: a row weighs its tokens), `rollout_rs_max`/`_min` over its units, and
    with a veto `rollout_is_veto_fraction`; verl HEAD `rollout_rs_<option>_{mean,max,min,
    fraction_high,fraction_low,masked_fraction,seq_masked_fraction}`.
    """
    if not criteria:
        raise ValueError("rejection needs at least one criterion")
    if veto is not None and veto <= 0.0:
        raise ValueError(f"rollout_token_veto_threshold must be > 0, got {veto}")
    valid = valid_mask(mask)
    rows = valid.any(dim=-1)
    rho = log_ratio(old_logprobs, behaviour_logprobs, valid)
    keep = valid.clone()
    metrics: dict[str, float] = {}
    head = criteria[0].option not in ("token", "sequence", "geometric")
    for criterion in criteria:
        statistic, kept, upper, lower = _criterion_test(criterion, rho, valid)
        kept_tokens = valid & _rows(kept).expand_as(valid)
        keep &= kept_tokens
        units = valid if statistic.dim() == 2 else rows
        high, low = _extremes(statistic, units)
        if not head:
            metrics |= {
                "rollout_corr/rollout_rs_mean": _token_mean(statistic, valid),
                "rollout_corr/rollout_rs_max": high,
                "rollout_corr/rollout_rs_min": low,
            }
            continue
        prefix = f"rollout_corr/rollout_rs_{criterion.option}"
        dropped = valid & ~kept_tokens
        metrics |= {
            f"{prefix}_mean": _token_mean(statistic, valid),
            f"{prefix}_max": high,
            f"{prefix}_min": low,
            f"{prefix}_fraction_high": masked_mean((statistic > upper).float(), units).item(),
            f"{prefix}_fraction_low": masked_mean((statistic < lower).float(), units).item()
            if lower is not None
            else 0.0,
            f"{prefix}_masked_fraction": masked_mean(dropped.float(), valid).item(),
            f"{prefix}_seq_masked_fraction": masked_mean(dropped.any(dim=-1).float(), rows).item(),
        }
    rejected = valid & ~keep
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(rejected.float(), valid).item()
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = masked_mean(rejected.any(dim=-1).float(), rows).item()
    if veto is not None:
        vetoed = ((rho < math.log(veto)) & valid).any(dim=-1)
        keep &= ~_rows(vetoed).expand_as(valid)
        metrics["rollout_corr/rollout_is_veto_fraction"] = masked_mean(vetoed.float(), rows).item()
    return keep.float(), metrics
