"""Per-token entropy of the policy from its logits, in chunks so memory stays ~ one chunk × V.

A full softmax over ``[B, T, V]`` logits is as large as the logits themselves (and kept for
backward, larger still in float32); the entropy only needs a ``[B, T]`` result, so it is
computed over chunks of tokens, each chunk's softmax recomputed in backward instead of kept.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# Tokens per chunk: with a 150k vocabulary one float32 chunk of softmax is ~0.6 GB.
DEFAULT_CHUNK_SIZE = 1024


def _chunk_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - Σ_v softmax(z)_v · z_v`` over the last dim, in float32: ``[n, V] -> [n]``."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _token_rows(logits: torch.Tensor) -> list[torch.Tensor]:
    """``[B, T, V]`` as 2-D ``[n, V]`` views, never a copy.

    One view of all ``B·T`` rows when the strides allow it; otherwise (a target-aligned slice
    such as ``logits[:, :-1]`` cannot be flattened without copying) one view per sequence.
    """
    vocab = logits.shape[-1]
    try:
        return [logits.view(-1, vocab)]
    except RuntimeError:
        return [row.view(-1, vocab) for row in logits.unbind(0)]


def token_entropy(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """The entropy of the next-token distribution at every position: ``[B, T, V] -> [B, T]`` float32.

    ``H = logsumexp(z) - Σ_v softmax(z)_v · z_v``, over chunks of ``chunk_size`` tokens
    (``DEFAULT_CHUNK_SIZE`` when None). When the logits require grad (and grad is enabled),
    each chunk runs under activation checkpointing, so backward recomputes that chunk's softmax
    rather than keeping every chunk's.
    """
    size = chunk_size or DEFAULT_CHUNK_SIZE
    if size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    recompute = torch.is_grad_enabled() and logits.requires_grad
    parts: list[torch.Tensor] = []
    for rows in _token_rows(logits):
        for chunk in rows.split(size, dim=0):
            if recompute:
                parts.append(checkpoint(_chunk_entropy, chunk, use_reentrant=False))
            else:
                parts.append(_chunk_entropy(chunk))
    return torch.cat(parts).view(logits.shape[:-1])
