"""Per-token policy-gradient losses (verl's ``compute_policy_loss_*``), before any aggregation.

Each loss maps a ``PolicyLossInputs`` and a ``ClipRange`` to ``PolicyLossTerms``: the ``[B, T]``
loss of every token (0 off the mask) and per-token indicators the caller averages into metrics.
Reducing ``per_token`` to the scalar that is optimised is ``aggregate.aggregate``'s job, so the
same loss works under every ``loss_agg_mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollover.config.algorithm import CorrectionLossType
from rollover.training.loss.masked import LOG_RATIO_BOUND, on_mask, valid_mask

LossType = CorrectionLossType


@dataclass(frozen=True)
class PolicyLossInputs:
    """The ``[B, T]`` target-aligned tensors of one micro-batch.

    ``logprobs`` is ``log π_θ`` and the only input that should carry gradient; ``old_logprobs``
    is ``log π_old`` (in bypass mode the behaviour policy's ``log μ``); ``advantages`` may also be
    ``[B, 1]``; ``is_weights`` are detached truncated importance weights that multiply each
    token's loss (``correction.importance_weights``), or None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class ClipRange:
    """verl's ``clip_ratio_low`` (ε_low), ``clip_ratio_high`` (ε_high) and ``clip_ratio_c`` (c > 1).

    ``low != high`` is clip-higher (DAPO): the ratio is clipped to ``[1 - low, 1 + high]``.
    """

    low: float = 0.2
    high: float = 0.2
    dual_c: float = 3.0

    def __post_init__(self) -> None:
        if self.low < 0 or self.high < 0:
            raise ValueError(f"clip ratios must be >= 0, got low={self.low}, high={self.high}")
        if self.dual_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.dual_c}")


@dataclass(frozen=True)
class PolicyLossTerms:
    """A policy loss per token, and per-token 0/1 float indicators for metrics.

    - ``per_token``: the loss, 0 off the mask.
    - ``clipped``: the ε-clipped branch is strictly larger than the unclipped one (verl's
      ``pg_clipfrac`` numerator).
    - ``dual_clipped``: ``A < 0`` and the dual cap ``-c·A`` is active (``pg_clipfrac_lower``).
    - ``log_ratio``: ``log π_θ - log π_old``, detached, 0 off the mask (``ppo_kl`` is minus its
      mean).
    """

    per_token: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    log_ratio: torch.Tensor


PolicyLossFn = Callable[[PolicyLossInputs, ClipRange], PolicyLossTerms]


def _weighted(per_token: torch.Tensor, inputs: PolicyLossInputs, valid: torch.Tensor) -> torch.Tensor:
    """``l · w`` with ``w`` the detached IS weights (0 off the mask), or ``l`` when there are none."""
    if inputs.is_weights is None:
        return per_token
    return per_token * on_mask(inputs.is_weights.detach(), valid)


def ppo_clip(inputs: PolicyLossInputs, clip: ClipRange) -> PolicyLossTerms:
    """Dual-clip PPO with clip-higher, per token (verl's ``compute_policy_loss_vanilla``).

    ``r = exp(clamp(log π_θ - log π_old, -20, 20))``,
    ``l1 = -A·r``, ``l2 = -A·clamp(r, 1 - ε_low, 1 + ε_high)``, ``l = max(l1, l2)``;
    for ``A < 0`` also ``l = min(l, -c·A)`` so a huge ratio on a bad token cannot blow up;
    finally ``l·w`` with the IS weights ``w`` when given.
    """
    valid = valid_mask(inputs.mask)
    new_lp = on_mask(inputs.logprobs, valid)
    old_lp = on_mask(inputs.old_logprobs.detach(), valid)
    adv = on_mask(inputs.advantages.detach(), valid)

    log_ratio = new_lp - old_lp
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_cap = -clip.dual_c * adv
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(pessimistic, dual_cap), pessimistic)

    return PolicyLossTerms(
        per_token=_weighted(per_token, inputs, valid),
        clipped=((clipped > unclipped) & valid).float(),
        dual_clipped=(negative & (pessimistic > dual_cap) & valid).float(),
        log_ratio=log_ratio.detach(),
    )


def reinforce(inputs: PolicyLossInputs, clip: ClipRange) -> PolicyLossTerms:
    """REINFORCE, per token (verl's ``compute_policy_loss_reinforce``): ``l = -A · log π_θ · w``.

    ``w`` is the IS weights, or 1. ``clip`` is not used (nothing is clipped); it keeps one
    signature for every ``LossType``. ``clipped`` and ``dual_clipped`` are all 0.
    """
    valid = valid_mask(inputs.mask)
    new_lp = on_mask(inputs.logprobs, valid)
    old_lp = on_mask(inputs.old_logprobs.detach(), valid)
    adv = on_mask(inputs.advantages.detach(), valid)
    return PolicyLossTerms(
        per_token=_weighted(-adv * new_lp, inputs, valid),
        clipped=torch.zeros_like(new_lp),
        dual_clipped=torch.zeros_like(new_lp),
        log_ratio=(new_lp - old_lp).detach(),
    )


POLICY_LOSSES: dict[LossType, PolicyLossFn] = {
    "ppo_clip": ppo_clip,
    "reinforce": reinforce,
}
