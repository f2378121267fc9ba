"""vLLM's LoRA ops on CPU, one matrix product per adapter instead of one per token (installed
in every vLLM process by `rollover.engine.vllm_plugin`).

vLLM 0.32 applies LoRA on CPU with its PyTorch ops (`vllm.lora.ops.torch_ops`), which first
copy each token's adapter matrices out of the stacked slots (`weights[indices]`: a
`[tokens, out, rank]` tensor, for every LoRA layer of every forward pass) and then multiply
token by token (`einsum("bi, boi -> bo")`). On SmolLM2-135M with a rank-16 adapter on every
linear layer that more than doubled a short request's prefill (0.21 s without the adapter,
0.45 s with it, 2 loaded cores). The tokens of a batch use a handful of adapters, mostly one:
here each adapter's tokens are multiplied by its matrices in one product, the rest of each op
(scaling, slicing, padding, accumulating) as vLLM's. A token whose index is -1 gets no
adapter, as vLLM's kernels document (its PyTorch ops read slot -1, the last, instead). Ops
other than these, and GPU kernels, are untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

OPS_MODULE = "vllm.lora.ops.torch_ops.lora_ops"
# Modules that bind the ops by name at import (`from ... import bgmv_expand`).
BINDING_MODULES = ("vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu")


def per_token_product(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> Any:
    """`out[t] = weights[indices[t]] @ inputs[t]` (zero where `indices[t] < 0`), in `dtype`, with
    one product per adapter used: `weights` is `[slots, out, in]` (or `[slots, 1, out, in]`),
    `inputs` `[tokens, in]`. None where the shapes are not that (the caller falls back)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    tokens = inputs.shape[0]
    if weights.dim() != 3 or inputs.dim() != 2 or indices.dim() != 1 or indices.shape[0] != tokens or tokens == 0:
        return None
    inputs = inputs.to(dtype=dtype)
    first = int(indices[0])
    if first >= 0 and bool((indices == first).all()):  # the usual batch: one adapter throughout
        return inputs @ weights[first].to(dtype=dtype).t()
    out = inputs.new_zeros(tokens, weights.shape[1])
    for slot in indices.unique().tolist():
        if slot >= 0:
            rows = (indices == slot).nonzero().squeeze(1)
            out[rows] = inputs[rows] @ weights[slot].to(dtype=dtype).t()
    return out


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = per_token_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        _ORIGINAL["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        return
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # LoRA adapter and model may add different amounts of padding to output
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = per_token_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        _ORIGINAL["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        return
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = per_token_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        _ORIGINAL["bgmv_expand_slice"](
            inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
        )
        return
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


OURS: dict[str, Callable[..., None]] = {
    "bgmv_expand": bgmv_expand,
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand_slice": bgmv_expand_slice,
}
_ORIGINAL: dict[str, Callable[..., None]] = {}


def install() -> None:
    """Put these ops in place of vLLM's (idempotent). vLLM's `sgmv_*` ops (prefill) call its
    `bgmv_*` ones through their module, so they take these too."""
    import importlib

    ops = importlib.import_module(OPS_MODULE)
    for name, op in OURS.items():
        current = getattr(ops, name)
        if current is not op:
            _ORIGINAL[name] = current
            setattr(ops, name, op)
        for module_name in BINDING_MODULES:
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, name, None) is _ORIGINAL[name]:
                setattr(module, name, op)
