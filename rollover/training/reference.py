"""The frozen reference policy π_ref of the KL terms (verl's `actor_rollout_ref.ref`).

The model as it was when the run began, never updated (with LoRA: the policy's own base,
its adapter disabled, `AdapterOffReference`). `Policy` builds one only when a KL term
needs it (`use_kl_loss` or `algorithm.use_kl_in_reward`). On several ranks it is sharded like
the actor (FSDP2); `ref.fsdp_config.param_offload` keeps its weights on the host between
forward passes (FSDP2's CPU offload on several ranks; on one GPU rank the model moves to the
device for its passes and back). On a CPU machine the host is the device: offload changes
nothing there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from rollover.config import RolloverConfig
from rollover.distributed import sharding
from rollover.distributed.world import World
from rollover.training.forward import Batching, per_sample_logprobs
from rollover.training.samples import Sample


class ReferencePolicy:
    def __init__(self, model_path: str | Path, config: RolloverConfig, world: World, device: torch.device) -> None:
        from rollover.vision.model import auto_model_class

        self.config = config
        self.world = world
        self.device = device
        model: torch.nn.Module = auto_model_class(model_path).from_pretrained(model_path, dtype=torch.float32)
        model.config.use_cache = False  # type: ignore[union-attr]
        model.requires_grad_(False)
        model.eval()
        offload = config.actor_rollout_ref.ref.fsdp_config.param_offload
        # One rank offloads by moving the model; several let FSDP2 keep the shards on the host.
        self.moves = offload and not world.distributed and device.type != "cpu"
        if world.distributed:
            fsdp = config.actor_rollout_ref.actor.fsdp_config
            mixed = fsdp.mixed_precision == "bf16" or (fsdp.mixed_precision == "auto" and device.type == "cuda")
            model = sharding.shard_model(model.to(device), mixed_precision=mixed, offload=offload)
        elif not self.moves:
            model = model.to(device)
        self.model = model

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        if not self.moves:
            yield
            return
        self.model.to(self.device)
        try:
            yield
        finally:
            self.model.to("cpu")

    def logprobs(self, samples: Sequence[Sample], pad_token_id: int, temperature: float) -> list[torch.Tensor]:
        """log π_ref of every sample's tokens (target-aligned, on the host), in micro-batches of
        `ref.log_prob_micro_batch_size_per_gpu` (or by token budget), the ranks sharing them."""
        with self._on_device():
            return _reference_logprobs(
                self.model, self.config, self.world, self.device, samples, pad_token_id, temperature
            )


class AdapterOffReference:
    """LoRA's π_ref: the policy's own model with its adapter disabled (peft's
    `disable_adapter`), i.e. the base the run started from. No second model is held; on
    several ranks the passes run on the actor's shards."""

    def __init__(self, model: torch.nn.Module, config: RolloverConfig, world: World, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.world = world
        self.device = device

    def logprobs(self, samples: Sequence[Sample], pad_token_id: int, temperature: float) -> list[torch.Tensor]:
        """log π_ref as `ReferencePolicy.logprobs` computes it, through the base weights alone."""
        with self.model.disable_adapter():  # type: ignore[operator]
            return _reference_logprobs(
                self.model, self.config, self.world, self.device, samples, pad_token_id, temperature
            )


def _reference_logprobs(
    model: torch.nn.Module,
    config: RolloverConfig,
    world: World,
    device: torch.device,
    samples: Sequence[Sample],
    pad_token_id: int,
    temperature: float,
) -> list[torch.Tensor]:
    """log π_ref of every sample's tokens through `model` as it stands, in micro-batches of
    `ref.log_prob_micro_batch_size_per_gpu` (or by `ref.log_prob_max_token_len_per_gpu` with
    `log_prob_use_dynamic_bsz`), the ranks sharing them."""
    ref = config.actor_rollout_ref.ref
    budget = ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None
    return per_sample_logprobs(
        model,
        samples,
        pad_token_id=pad_token_id,
        temperature=temperature,
        world=world,
        device=device,
        batching=Batching(config.ref_logprob_micro_batch_size, budget),
    )
