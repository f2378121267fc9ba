"""Masked-tensor helpers that every loss module shares.

``mask`` is 1 (or True) on trained tokens and 0 elsewhere; it may be bool, int or float.
Masked-out positions may hold anything, NaN and inf included, so values are replaced with
``torch.where`` *before* any arithmetic: multiplying by the mask instead would turn
``0 * inf`` into NaN, and even a ``where`` applied after ``exp`` lets NaN into the gradient.
"""

from __future__ import annotations

import torch

# Bound on log-ratios before exp(): exp(20) ~ 4.9e8 is far beyond any clip threshold, and the
# bound keeps exp() (and its gradient) finite when two policies disagree wildly.
LOG_RATIO_BOUND = 20.0


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool: True on trained tokens."""
    return mask.bool()


def on_mask(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values`` in float32 where ``valid``, exactly 0 elsewhere (garbage never reaches arithmetic)."""
    return torch.where(valid, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``Σ valid·v / max(1, Σ valid)``: the mean over valid entries, 0 when there are none."""
    return on_mask(values, valid).sum() / valid.sum().clamp(min=1)
