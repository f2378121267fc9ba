"""From a ``[B, T]`` per-token loss to the scalar one micro-batch contributes (verl's ``agg_loss``).

One mini-batch (one optimizer step) is split into micro-batches, and across ranks. Every mode
here divides by counts of the *whole mini-batch* (``BatchCounts``), never of the micro-batch in
hand, so each mode is a sum over rows divided by a constant: summing ``aggregate`` over all the
micro-batches of all the ranks gives exactly the loss of the mini-batch computed at once, and
gradient accumulation (plus an all-reduce *sum* across ranks) takes the step one big batch would.

The caller sums ``local_counts`` over its micro-batches and all-reduces them to build the
mini-batch's ``BatchCounts`` before the first backward.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from rollover.config.actor_rollout_ref import LossAggMode
from rollover.training.loss.masked import on_mask, valid_mask


@dataclass(frozen=True)
class BatchCounts:
    """Counts of one whole mini-batch: all its micro-batches, on all ranks.

    - ``n_tokens``: masked tokens.
    - ``n_sequences``: rows with at least one masked token.
    - ``norm_length``: the constant length of ``seq-mean-token-sum-norm`` (Dr. GRPO divides by
      the maximum response length rather than by each sequence's own length).
    """

    n_tokens: float
    n_sequences: float
    norm_length: float


AggregationFn = Callable[[torch.Tensor, torch.Tensor, BatchCounts], torch.Tensor]


def local_counts(mask: torch.Tensor) -> tuple[float, float]:
    """This micro-batch's ``(masked tokens, rows with at least one masked token)``."""
    valid = valid_mask(mask)
    return float(valid.sum().item()), float(valid.any(dim=-1).sum().item())


def mini_batch_counts(masks: Sequence[torch.Tensor], norm_length: float) -> BatchCounts:
    """The counts of a mini-batch whose rows' trained masks are `masks` (each `[T]`)."""
    n_tokens = n_sequences = 0.0
    for mask in masks:
        tokens, sequences = local_counts(mask.unsqueeze(0))
        n_tokens += tokens
        n_sequences += sequences
    return BatchCounts(n_tokens, n_sequences, norm_length)


def _row_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t m_t·v_t`` per row: ``[B]``."""
    return on_mask(values, valid_mask(mask)).sum(dim=-1)


def token_mean(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """``Σ_{b,t} m·v / n_tokens``: every token of the mini-batch weighs the same."""
    return _row_sums(values, mask).sum() / max(1.0, counts.n_tokens)


def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """``Σ_b (Σ_t m·v) / n_sequences``: the sequence mean of each sequence's token sum."""
    return _row_sums(values, mask).sum() / max(1.0, counts.n_sequences)


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """``Σ_b (Σ_t m·v / Σ_t m) / n_sequences``: the sequence mean of each sequence's token mean.

    A row with no masked token contributes 0 (its token count is clamped to 1).
    """
    row_tokens = valid_mask(mask).sum(dim=-1).clamp(min=1)
    return (_row_sums(values, mask) / row_tokens).sum() / max(1.0, counts.n_sequences)


def seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """``Σ_b (Σ_t m·v) / (n_sequences · norm_length)``: Dr. GRPO's paper, each sequence's token
    sum over a constant length, averaged over the mini-batch's sequences.

    A deliberate deviation from verl, whose ``agg_loss`` takes ``Σ_b (Σ_t m·v) / loss_scale_factor``
    with no mean over sequences: for ``ones[2, 3]`` all masked and ``loss_scale_factor`` 4 verl
    gives 1.5, this 0.75. verl's value then depends on how the mini-batch is split (its actor
    averages the micro-batches' values: the sum of a micro-batch of m sequences scales with m);
    this one is the same however the mini-batch is split into micro-batches and ranks.
    """
    denominator = max(1.0, counts.n_sequences) * max(1.0, counts.norm_length)
    return _row_sums(values, mask).sum() / denominator


AGGREGATIONS: dict[LossAggMode, AggregationFn] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: LossAggMode, counts: BatchCounts) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss under ``mode`` (see ``AGGREGATIONS``).

    ``values`` are ``[B, T]`` per-token losses; positions off the mask are ignored, whatever
    they hold. Summed over the mini-batch's micro-batches and ranks, the shares make the loss of
    the whole mini-batch.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode must be one of {list(AGGREGATIONS)}, got {mode!r}")
    return AGGREGATIONS[mode](values, mask, counts)


def rollout_row_divisors(rollout_ids: Sequence[Hashable], row_tokens: Sequence[float]) -> list[float]:
    """Agent Lightning's ``per_rollout_mean`` divisor of every row of a whole update batch.

    ``divisor[i] = max(1, N_ρ(i) · R)`` with ``N_ρ = Σ_{j : id_j = ρ} row_tokens[j]`` the masked
    tokens of row ``i``'s rollout over all of that rollout's rows, and ``R = len(rollout_ids)``
    the number of rows in the batch. Each rollout then weighs ``1/R``, so a batch whose
    rollouts span several rows sums to ``(rollouts)/R`` rather than 1 (a constant scale of the
    step; dividing by the number of distinct rollouts instead would make it 1).
    """
    if len(rollout_ids) != len(row_tokens):
        raise ValueError(f"{len(rollout_ids)} rollout ids for {len(row_tokens)} rows")
    rollout_tokens: dict[Hashable, float] = {}
    for rollout_id, tokens in zip(rollout_ids, row_tokens):
        rollout_tokens[rollout_id] = rollout_tokens.get(rollout_id, 0.0) + float(tokens)
    n_rows = len(rollout_ids)
    return [max(1.0, rollout_tokens[rollout_id] * n_rows) for rollout_id in rollout_ids]


def per_rollout_mean(
    values: torch.Tensor, mask: torch.Tensor, row_divisors: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """``Σ_b (Σ_t m·v) / row_divisors[b]`` (Agent Lightning's ``per_rollout_mean`` loss mode).

    With ``row_divisors`` from ``rollout_row_divisors`` over the whole update batch, a rollout's
    tokens are averaged over all of its rows, and every rollout weighs the same however many
    rows (samples) it was split into. Pass this micro-batch's slice of the divisors; the shares
    of the micro-batches sum to the batch's loss.
    """
    divisors = torch.as_tensor(row_divisors, dtype=torch.float32, device=values.device)
    return (_row_sums(values, mask) / divisors).sum()
