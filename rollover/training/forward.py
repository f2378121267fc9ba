"""Forward passes over a batch of samples, shared out over the trainer ranks.

Every rank holds the whole batch. `rank_passes` gives each rank its share (balanced by
tokens) cut into forward passes, by count or by token budget (verl's `use_dynamic_bsz`), and
how many passes every rank must run: FSDP's gathers need the same number on each rank, so a
rank out of samples runs stand-in passes. `per_sample_logprobs` is the no-grad use of it (π_old,
π_ref): each rank computes its share, then every rank gets every sample's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollover.distributed import sharding
from rollover.distributed.split import balanced_split, micro_batches
from rollover.distributed.world import World
from rollover.training.logprobs import token_logprobs
from rollover.training.samples import Sample, collate


@dataclass(frozen=True)
class Batching:
    """Samples per forward pass on a rank, or (with `token_budget`) padded tokens per pass."""

    size: int
    token_budget: int | None = None


def rank_passes(lengths: Sequence[int], world: World, batching: Batching) -> tuple[list[list[int]], int]:
    """This rank's forward passes (indices into `lengths`) and how many passes every rank runs."""
    per_rank: list[list[list[int]]] = []
    for part in balanced_split(lengths, world.size):
        passes = micro_batches([lengths[i] for i in part], size=batching.size, token_budget=batching.token_budget)
        per_rank.append([[part[i] for i in chunk] for chunk in passes])
    return per_rank[world.rank], max(1, max(len(passes) for passes in per_rank))


def per_sample_logprobs(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    pad_token_id: int,
    temperature: float,
    world: World,
    device: torch.device,
    batching: Batching,
) -> list[torch.Tensor]:
    """Every sample's target-aligned logprobs (``[len - 1]``, on the host) under `model`, with
    no gradient, the ranks sharing the work."""
    mine, n_passes = rank_passes([len(s) for s in samples], world, batching)
    computed: dict[int, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for position in range(n_passes):
            indices = mine[position] if position < len(mine) else []
            chunk = [samples[i] for i in indices] or [samples[0]]  # a stand-in keeps FSDP's gathers in step
            batch = {k: v.to(device) for k, v in collate(chunk, pad_token_id).items()}
            logprobs = token_logprobs(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                temperature=temperature,
                pixel_values=batch.get("pixel_values"),
                image_grid_thw=batch.get("image_grid_thw"),
            )
            for row, index in enumerate(indices):
                computed[index] = logprobs[row, : len(samples[index]) - 1].cpu()
    model.train(was_training)
    if world.distributed:
        for part in sharding.all_gather_objects(computed):
            computed.update(part)
    return [computed[i] for i in range(len(samples))]
