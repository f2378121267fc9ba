"""FSDP2 for a Hugging Face causal LM: shard it, gather it whole, checkpoint it sharded.

Every function here is a collective when the process group spans several ranks: all ranks
call it, in the same order.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (`model.layers` in Llama-style models): one FSDP unit each."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("layers") and len(module) > 0:
            return list(module)
    return []


def shard_model(
    model: torch.nn.Module,
    *,
    mixed_precision: bool = False,
    offload: bool = False,
) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, norm, head, tied weights).
    `mixed_precision`: bf16 compute with fp32 gradient reduction; `offload`: parameters,
    gradients and the optimizer step on the host (`CPUOffloadPolicy`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {}
    if mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor all-gathered whole (a collective); a plain tensor as it is."""
    gather = getattr(value, "full_tensor", None)
    return gather() if callable(gather) else value


def full_state_dict(model: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The model's weights whole, on the host, streamed one tensor at a time so no rank holds
    more than one gathered tensor beyond what it keeps. Ranks with `keep` false take part in
    the gathers and get an empty dict. A tensor shared under two names (tied embeddings) is
    returned once, under its first name."""
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = every_name - {name for name, _ in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name in tied:
            continue
        whole = full_tensor(value.detach())
        if keep:
            out[name] = whole.to("cpu", copy=True)
    return out


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """One rank without a process group is a supported world here, not a mistake to warn of."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool
) -> tuple[dict[str, Any], dict[str, Any], StateDictOptions | None]:
    """The model's and optimizer's state dicts (DCP's names), and the options that set them
    back. `trainable_only` (LoRA): the frozen base is the model the run started from, not
    training state; a tied weight slips through `ignore_frozen_params`, so it goes by name."""
    if not trainable_only:
        model_state, optim_state = get_state_dict(model, optimizer)
        return model_state, optim_state, None
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trainable}, optim_state, options


def save_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *, trainable_only: bool = False
) -> None:
    """Model and optimizer, each rank writing its own shards (`torch.distributed.checkpoint`);
    `load_training_state` reads them back on any number of ranks. `trainable_only`: the
    parameters that train (a LoRA adapter) and their optimizer state, not the frozen ones."""
    _fill_adam_state(optimizer)
    model_state, optim_state, _ = _training_state(model, optimizer, trainable_only)
    with _one_process_is_intended():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def _fill_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """(AdamW's, the policy's optimizer.) Give every parameter that has not stepped yet (a policy none of whose steps has come)
    AdamW's fresh state, as its first step would: a checkpoint holds every parameter's state,
    or one with some missing could not be loaded (DCP loads into a full template). A fresh
    optimizer (no state at all) is left to torch, which builds its state for the checkpoint."""
    if not optimizer.state:
        return
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if not optimizer.state[parameter]:
                optimizer.state[parameter] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                }


def load_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *, trainable_only: bool = False
) -> None:
    """Reshards as needed: a checkpoint saved by 2 ranks loads on 1, and the other way round.
    Every key saved with the same `trainable_only` must be in the checkpoint."""
    model_state, optim_state, options = _training_state(model, optimizer, trainable_only)
    with _one_process_is_intended():
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (one rank: `[value]`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def all_reduce_sum(value: int, device: torch.device) -> int:
    """The sum of every rank's `value` (`device`: where the backend reduces, cuda for NCCL)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())
