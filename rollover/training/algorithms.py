"""Advantage estimators, rollout correction and the PPO policy loss (SPEC §5).

All per-token tensors are ``[B, T]`` and target-aligned (see ``samples.collate``): position ``t``
holds quantities for the token that is predicted there. ``mask`` is 1 on model-generated tokens
and 0 elsewhere (prompt, tool/env tokens, padding); it may be bool, int or float.

Every masked-out position is neutralised with ``torch.where`` before any arithmetic, so
padding may hold anything (even NaN or inf) without touching the loss or its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

AdvEstimator = Literal["grpo", "rloo"]
RolloutIsMode = Literal["token", "sequence"]

# Bound on log-ratios before exp(): exp(20) ~ 4.9e8 is far beyond any clip threshold, and the
# bound keeps exp() (and its gradient) finite when two policies disagree wildly.
_LOG_RATIO_BOUND = 20.0


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    estimator: AdvEstimator,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per rollout, normalised within each group of ``group_ids``.

    - ``grpo``: ``(s - mean_g) / (std_g + eps)`` with the unbiased std.
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
        if estimator == "grpo":
            advantages[idx] = centred / (group.std(correction=1) + eps)
        else:
            advantages[idx] = centred * (n / (n - 1))

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return advantages.to(out_dtype)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum()
    return torch.where(mask, values, torch.zeros_like(values)).sum() / count.clamp(min=1)


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: RolloutIsMode | None,
    threshold: float,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated importance weights ``π_old / μ`` that correct for an off-policy sampler.

    ``mode`` is ``algorithm.rollout_correction.rollout_is``; ``threshold`` is C
    (``rollout_is_threshold``). Returns ``(weights, metrics)``; ``(None, {})`` when off.

    - ``token``: ``w_t = min(exp(clamp(logπ_old - logμ, ±20)), C)``.
    - ``sequence``: ``w = min(exp(clamp(Σ_t m_t (logπ_old - logμ), ±20)), C)``, one weight per
      sample broadcast over its tokens.

    The weights are detached (they rescale the loss, they are not optimised) and are 0 on
    masked-out positions. ``behaviour_logprobs`` must be finite on masked tokens; NaN there
    (a response recorded without logprobs) would make the weights NaN.

    Metrics, as verl reports them: over masked tokens (token mode) or over samples with at
    least one masked token (sequence mode), of the weights *before* truncation (so ``is_max``
    shows how far μ is, not C): ``is_mean``, ``is_max``, ``clipped_fraction`` = share above C;
    also under verl's names ``rollout_is_mean``, ``rollout_is_max``, ``rollout_is_min``,
    ``rollout_is_ratio_fraction_high`` (= clipped_fraction) and ``rollout_is_ratio_fraction_low``
    (share below 1/C). ``rollout_corr/kl`` (verl's name too) is the k1 estimate of KL(μ || π_old):
    the mean over masked tokens of ``logμ - logπ_old``, unbiased because the tokens were
    sampled from μ. Call it once on the whole batch: metrics of micro-batches do not average
    into the batch's (a maximum does not).
    """
    if mode is None:
        return None, {}
    if mode not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be null, 'token' or 'sequence', got {mode!r}")
    valid = mask.bool()
    zeros = torch.zeros_like(old_logprobs, dtype=torch.float32)
    log_ratio = torch.where(valid, old_logprobs.detach().float() - behaviour_logprobs.detach().float(), zeros)

    if mode == "token":
        raw = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        weights = torch.where(valid, raw.clamp(max=threshold), zeros)
        units_valid = valid
        unit_raw = raw
    else:
        seq_log_ratio = log_ratio.sum(dim=-1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        unit_raw = torch.exp(seq_log_ratio)
        unit_weights = unit_raw.clamp(max=threshold)
        units_valid = valid.any(dim=-1)
        weights = torch.where(valid, unit_weights.unsqueeze(-1).expand_as(zeros), zeros)

    if bool(units_valid.any()):
        is_mean = _masked_mean(unit_raw, units_valid).item()
        is_max = unit_raw[units_valid].max().item()
        is_min = unit_raw[units_valid].min().item()
        fraction_high = _masked_mean((unit_raw > threshold).float(), units_valid).item()
        fraction_low = _masked_mean((unit_raw < 1.0 / threshold).float(), units_valid).item()
    else:
        is_mean = is_max = is_min = fraction_high = fraction_low = 0.0
    kl = _masked_mean(-log_ratio, valid).item()

    metrics = {
        "rollout_corr/is_mean": is_mean,
        "rollout_corr/is_max": is_max,
        "rollout_corr/clipped_fraction": fraction_high,
        "rollout_corr/kl": kl,
        "rollout_corr/rollout_is_mean": is_mean,
        "rollout_corr/rollout_is_max": is_max,
        "rollout_corr/rollout_is_min": is_min,
        "rollout_corr/rollout_is_ratio_fraction_high": fraction_high,
        "rollout_corr/rollout_is_ratio_fraction_low": fraction_low,
    }
    return weights.detach(), metrics


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_c: float = 3.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO loss, token-mean over every masked token of the batch.

    ``r = exp(clamp(logπθ - logπ_old, ±20))``, ``l = max(-A r, -A clip(r, 1-ε, 1+ε))``, and for
    ``A < 0`` also ``l = min(l, -c A)`` so a huge ratio on a bad token cannot blow the loss up.
    ``is_weights`` (from ``rollout_correction_weights``) multiply ``l`` per token.

    Only ``logprobs`` should carry gradient. Metrics: ``actor/pg_clipfrac`` (masked tokens
    where the ε-clipped branch is strictly larger, i.e. active), ``actor/pg_clipfrac_dual`` (masked
    tokens capped by the dual clip), ``actor/ppo_kl`` (mean of ``logπ_old - logπθ``) and
    ``actor/pg_loss``.
    """
    valid = mask.bool()
    zeros = torch.zeros_like(logprobs, dtype=torch.float32)
    # Sanitise before use so garbage in padding cannot leak into values or gradients.
    new_lp = torch.where(valid, logprobs.float(), zeros)
    old_lp = torch.where(valid, old_logprobs.detach().float(), zeros)
    adv = torch.where(valid, advantages.detach().float(), zeros)

    log_ratio = new_lp - old_lp
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    dual_cap = -clip_ratio_c * adv
    dual_active = (adv < 0) & (per_token > dual_cap)
    per_token = torch.where(adv < 0, torch.minimum(per_token, dual_cap), per_token)

    if is_weights is not None:
        per_token = per_token * torch.where(valid, is_weights.detach().float(), zeros)

    loss = _masked_mean(per_token, valid)

    metrics = {
        "actor/pg_clipfrac": _masked_mean((clipped > unclipped).float(), valid).item(),
        "actor/pg_clipfrac_dual": _masked_mean(dual_active.float(), valid).item(),
        "actor/ppo_kl": _masked_mean(-log_ratio.detach(), valid).item(),
        "actor/pg_loss": loss.item(),
    }
    return loss, metrics
