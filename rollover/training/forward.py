"""Forward passes over a batch of samples, shared out over the trainer ranks.

Every rank holds the whole batch. `rank_passes` gives each rank its share (balanced by
tokens) cut into forward passes, by count or by token budget (verl's `use_dynamic_bsz`), and
how many passes every rank must run: FSDP's gathers need the same number on each rank, so a
rank out of samples runs stand-in passes. `per_sample_logprobs` is the no-grad use of it (π_old,
π_ref; and `recompute`, π_old with Σπ² for the optimal token baseline): each rank computes its
share, then every rank gets every sample's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from rollover.distributed import sharding
from rollover.distributed.split import balanced_split, micro_batches
from rollover.distributed.world import World
from rollover.training import lora
from rollover.training.logprobs import token_logprobs, token_logprobs_and_sum_pi_squared
from rollover.training.prepare import Recomputed
from rollover.training.samples import Sample, collate
from rollover.training.update_settings import ActorSettings, Batching


class ReferenceLike(Protocol):
    def logprobs(self, samples: Sequence[Sample], pad_token_id: int, temperature: float) -> list[torch.Tensor]: ...


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
    return [
        logprobs
        for logprobs, _ in _per_sample(model, samples, pad_token_id, temperature, world, device, batching, False)
    ]


def _per_sample(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    pad_token_id: int,
    temperature: float,
    world: World,
    device: torch.device,
    batching: Batching,
    sum_pi_squared: bool,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    mine, n_passes = rank_passes([len(s) for s in samples], world, batching)
    computed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for position in range(n_passes):
            indices = mine[position] if position < len(mine) else []
            chunk = [samples[i] for i in indices] or [samples[0]]  # a stand-in keeps FSDP's gathers in step
            batch = {k: v.to(device) for k, v in collate(chunk, pad_token_id).items()}
            ids, mask = batch["input_ids"], batch["attention_mask"]
            pixels, grid = batch.get("pixel_values"), batch.get("image_grid_thw")  # a vision model's images
            squares: torch.Tensor | None = None
            if sum_pi_squared:
                logprobs, squares = token_logprobs_and_sum_pi_squared(
                    model, ids, mask, temperature=temperature, pixel_values=pixels, image_grid_thw=grid
                )
            else:
                logprobs = token_logprobs(
                    model, ids, mask, temperature=temperature, pixel_values=pixels, image_grid_thw=grid
                )
            for row, index in enumerate(indices):
                n = len(samples[index]) - 1
                computed[index] = (logprobs[row, :n].cpu(), None if squares is None else squares[row, :n].cpu())
    model.train(was_training)
    if world.distributed:
        for part in sharding.all_gather_objects(computed):
            computed.update(part)
    return [computed[i] for i in range(len(samples))]


def recompute(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    settings: ActorSettings,
    reference: ReferenceLike | None,
    *,
    pad_token_id: int,
    world: World,
    device: torch.device,
) -> list[Recomputed]:
    """What the update recomputes before its optimizer steps, for every sample, on every rank:
    log π_old (in bypass mode the recorded log μ instead: no pass), Σπ² when the estimator
    needs it, and log π_ref when a KL term does. Each sample goes through its own policy's
    adapter; every rank runs the same passes in the same order (they are collectives)."""
    update = settings.update
    found: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.empty(0), None)] * len(samples)
    if update.correction.bypass:
        found = [(torch.tensor(s.behaviour_logprobs[1:], dtype=torch.float32), None) for s in samples]
    else:
        policies = settings.policies
        names: list[str | None] = [*policies] or [None]
        parts = [[i for i, s in enumerate(samples) if s.policy == name] for name in policies] or [
            list(range(len(samples)))
        ]
        for name, indices in zip(names, parts):
            if not indices:
                continue
            if name is not None:
                lora.activate(model, name)
            chunk = [samples[i] for i in indices]
            passes = _per_sample(
                model, chunk, pad_token_id, update.temperature, world, device, settings.old_logprob_batches,
                update.needs_sum_pi_squared,
            )  # fmt: skip
            for i, value in zip(indices, passes):
                found[i] = value
    refs: list[torch.Tensor | None] = [None] * len(samples)
    if reference is not None:
        refs = list(reference.logprobs(samples, pad_token_id, update.temperature))
    return [Recomputed(old, ref, squares) for (old, squares), ref in zip(found, refs)]
