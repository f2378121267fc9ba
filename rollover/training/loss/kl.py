"""KL to a reference policy: per-token estimators (verl's ``kl_penalty``) and the KL-in-reward
coefficient controllers (verl's ``FixedKLController`` / ``AdaptiveKLController``).

Every estimator approximates ``KL(π_θ || π_ref)`` from the log-probs of the sampled tokens,
elementwise on ``[B, T]`` tensors (Schulman, "Approximating KL Divergence", 2020).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from rollover.config.actor_rollout_ref import KLType
from rollover.training.loss.masked import LOG_RATIO_BOUND, on_mask, valid_mask

KLBase = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]

# verl bounds the k3 estimate: one token whose ratio is off by e^20 must not swamp the penalty.
_K3_BOUND = 10.0
# Per update, the adaptive controller moves the coefficient by at most 20% (times n/horizon).
_ADAPTIVE_ERROR_BOUND = 0.2

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``log p - log p_ref`` (unbiased, high variance, can be negative)."""
    return logprob - ref_logprob


def abs_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``|log p - log p_ref|``."""
    return (logprob - ref_logprob).abs()


def k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``½ (log p - log p_ref)²`` (biased, low variance; its gradient is the true KL's)."""
    return 0.5 * (logprob - ref_logprob).square()


def k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``clamp(e^x - x - 1, -10, 10)`` with ``x = clamp(log p_ref - log p, -20, 20)``.

    Unbiased and never negative: verl's ``low_var_kl``.
    """
    x = (ref_logprob - logprob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return (torch.exp(x) - x - 1).clamp(-_K3_BOUND, _K3_BOUND)


KL_ESTIMATORS: dict[KLBase, KLEstimator] = {
    "kl": k1,
    "k1": k1,
    "abs": abs_kl,
    "mse": k2,
    "k2": k2,
    "low_var_kl": k3,
    "k3": k3,
}


def straight_through(value: torch.Tensor, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``k2 - k2.detach() + value.detach()``: the forward value of ``value``, the gradient of k2.

    The ``+`` variants of verl: an estimator's value for the penalty, and k2's unbiased gradient.
    """
    gradient_carrier = k2(logprob, ref_logprob)
    return gradient_carrier - gradient_carrier.detach() + value.detach()


def kl_estimate(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: KLType, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-token KL estimate ``kind`` (see ``KL_ESTIMATORS``); a trailing ``+`` is the
    straight-through variant (``straight_through``).

    With ``mask``, positions off it are 0 and their inputs never reach arithmetic (so garbage
    there cannot turn the gradient NaN); without it the inputs must be finite everywhere.
    """
    if kind not in get_args(KLType):
        raise ValueError(f"kl_penalty must be one of {list(get_args(KLType))}, got {kind!r}")
    if mask is not None:
        valid = valid_mask(mask)
        logprob, ref_logprob = on_mask(logprob, valid), on_mask(ref_logprob, valid)
    base: KLBase = kind.removesuffix("+")  # type: ignore[assignment]
    value = KL_ESTIMATORS[base](logprob, ref_logprob)
    return straight_through(value, logprob, ref_logprob) if kind.endswith("+") else value


def fixed_kl_coef(coef: float) -> float:
    """The fixed controller: ``β`` never changes."""
    return coef


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, target_kl: float, horizon: float) -> float:
    """The adaptive controller (Ziegler et al. 2019), after ``n_steps`` samples/steps at ``current_kl``.

    ``e = clip(KL / KL_target - 1, -0.2, 0.2)``, ``β ← β · (1 + e · n_steps / horizon)``: β grows
    when the KL is above target and shrinks below it, by at most 20% · n_steps / horizon.
    """
    error = min(max(current_kl / target_kl - 1.0, -_ADAPTIVE_ERROR_BOUND), _ADAPTIVE_ERROR_BOUND)
    return coef * (1.0 + error * n_steps / horizon)
