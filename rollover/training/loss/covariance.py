"""Which tokens Clip-Cov cuts and KL-Cov penalises (Cui et al. 2025, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models"; verl's `clip_cov` / `kl_cov`).

Both rank tokens by the covariance of their advantage and log-probability,
`cov_t = (A_t - mean(A))·(log π_t - mean(log π))`, means over the trained tokens considered.

verl chooses within each micro-batch from π_θ as it stands; here the choice is made once per
mini-batch (every micro-batch of every rank), from π_old, so it depends neither on how the
mini-batch is split into micro-batches and ranks nor on the order they run in (the first step of
an on-policy update has π_θ = π_old: the same covariances). Clip-Cov's random draw takes a
`torch.Generator` every rank seeds alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollover.training.loss.masked import on_mask, valid_mask
from rollover.training.samples import pad_rows
from rollover.training.update_settings import UpdateSettings


def covariance(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` `(A - mean A)·(log π - mean log π)` on the trained tokens (means over them), 0 elsewhere."""
    valid = valid_mask(mask)
    n = valid.sum().clamp(min=1)
    adv = on_mask(advantages.expand_as(logprobs), valid)
    logp = on_mask(logprobs.detach(), valid)
    cov = (adv - adv.sum() / n) * (logp - logp.sum() / n)
    return on_mask(cov, valid)


def clip_cov_selection(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float,
    lower: float,
    upper: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """`[B, T]` bool: `max(1, ⌊ratio·N⌋)` of the N trained tokens (or all candidates, when fewer)
    drawn at random from those with `lower < cov_t < upper`."""
    valid = valid_mask(mask)
    cov = covariance(advantages, logprobs, mask)
    candidates = torch.nonzero(valid & (cov > lower) & (cov < upper))
    chosen = torch.zeros_like(valid)
    n_cut = max(int(ratio * int(valid.sum())), 1)
    if len(candidates):
        picks = candidates[torch.randperm(len(candidates), generator=generator)[:n_cut]]
        chosen[picks[:, 0], picks[:, 1]] = True
    return chosen


def kl_cov_selection(
    advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, *, ratio: float
) -> torch.Tensor:
    """`[B, T]` bool: the `max(1, ⌊ratio·N⌋)` trained tokens of largest covariance (none when
    there is no trained token)."""
    valid = valid_mask(mask)
    n_valid = int(valid.sum())
    chosen = torch.zeros_like(valid)
    if n_valid == 0:
        return chosen
    cov = covariance(advantages, logprobs, mask)[valid]
    top = torch.topk(cov, max(1, int(n_valid * ratio))).indices
    positions = torch.nonzero(valid)[top]
    chosen[positions[:, 0], positions[:, 1]] = True
    return chosen


def mini_batch_selection(
    advantages: Sequence[torch.Tensor],
    old_logprobs: Sequence[torch.Tensor],
    trained: Sequence[torch.Tensor],
    settings: UpdateSettings,
    seed: int,
) -> list[torch.Tensor] | None:
    """The tokens clip_cov cuts or kl_cov penalises in one mini-batch, from its rows'
    advantages, π_old and trained masks, per row (float 0/1); None for the other losses.
    `seed` draws clip_cov's choice (the plan's, so every rank draws alike)."""
    loss, parameters = settings.loss.pg_loss, settings.parameters
    if loss not in ("clip_cov", "kl_cov"):
        return None
    width = max(len(t) for t in trained)
    mask, adv = pad_rows(list(trained), width), pad_rows(list(advantages), width)
    old = pad_rows([torch.nan_to_num(o) for o in old_logprobs], width)
    if loss == "clip_cov":
        chosen = clip_cov_selection(
            adv,
            old,
            mask,
            ratio=parameters.clip_cov_ratio,
            lower=parameters.clip_cov_lb,
            upper=parameters.clip_cov_ub,
            generator=torch.Generator().manual_seed(seed),
        )
    else:
        chosen = kl_cov_selection(adv, old, mask, ratio=parameters.kl_cov_ratio)
    return [chosen[i, : len(t)].float() for i, t in enumerate(trained)]
