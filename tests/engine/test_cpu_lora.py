"""The CPU LoRA ops the plugin puts in vLLM's place give vLLM's own results (one product per
adapter instead of one per token), and a token with no adapter (-1) gets none."""

from __future__ import annotations

import importlib

import pytest
import torch

from rollover.engine import cpu_lora

pytest.importorskip("vllm")


def vllm_ops() -> dict:
    ops = importlib.import_module(cpu_lora.OPS_MODULE)
    return {name: cpu_lora._ORIGINAL.get(name) or getattr(ops, name) for name in cpu_lora.OURS}


@pytest.mark.parametrize(
    "indices",
    [[0] * 6, [1] * 6, [0, 0, 0, 1, 1, 1], [1, 0, 1, 0, 0, 1], [0]],
    ids=["one adapter", "the other", "two in turn", "interleaved", "one token"],
)
def test_the_ops_give_vllm_s_results(indices):
    theirs = vllm_ops()
    generator = torch.Generator().manual_seed(0)
    tokens, hidden, rank, out = len(indices), 24, 4, 40
    lora_a = torch.randn(2, 1, rank, hidden, generator=generator)
    lora_b = torch.randn(2, 1, out, rank, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator)
    index = torch.tensor(indices)

    shrunk = {}
    for name, op in (("theirs", theirs["bgmv_shrink"]), ("ours", cpu_lora.bgmv_shrink)):
        shrunk[name] = torch.zeros(tokens, rank)
        op(x, lora_a, shrunk[name], index, 0.5)
    torch.testing.assert_close(shrunk["ours"], shrunk["theirs"])

    start = torch.randn(tokens, out + 8, generator=generator)  # the output wider than the slice
    for add in (True, False):
        expanded = {}
        for name, op in (("theirs", theirs["bgmv_expand_slice"]), ("ours", cpu_lora.bgmv_expand_slice)):
            expanded[name] = start.clone()
            op(shrunk["theirs"], lora_b, expanded[name], index, 3, out, add)
        torch.testing.assert_close(expanded["ours"], expanded["theirs"])
        for name, op in (("theirs", theirs["bgmv_expand"]), ("ours", cpu_lora.bgmv_expand)):
            expanded[name] = start.clone()
            op(shrunk["theirs"], lora_b, expanded[name], index, add)
        torch.testing.assert_close(expanded["ours"], expanded["theirs"])


def test_a_token_without_an_adapter_gets_none():
    lora_a, lora_b = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 16, 4)
    x, index = torch.randn(4, 8), torch.tensor([0, -1, 0, -1])
    shrunk = torch.full((4, 4), 7.0)
    cpu_lora.bgmv_shrink(x, lora_a, shrunk, index, 1.0)
    assert torch.equal(shrunk[1], torch.zeros(4)) and torch.equal(shrunk[3], torch.zeros(4))
    out = torch.ones(4, 16)
    cpu_lora.bgmv_expand(shrunk, lora_b, out, index, True)
    assert torch.equal(out[1], torch.ones(16)) and not torch.equal(out[0], torch.ones(16))


def test_install_reaches_the_prefill_ops_and_the_cpu_wrapper():
    cpu_lora.install()
    cpu_lora.install()  # idempotent: vLLM's ops stay the originals kept
    ops = importlib.import_module(cpu_lora.OPS_MODULE)
    wrapper = importlib.import_module("vllm.lora.punica_wrapper.punica_cpu")
    for name, op in cpu_lora.OURS.items():
        assert getattr(ops, name) is op and getattr(wrapper, name) is op
        assert cpu_lora._ORIGINAL[name] is not op
    # vLLM's prefill ops (sgmv_*) call the bgmv_* ops through their module: ours.
    x, lora_a, index = torch.randn(3, 8), torch.randn(1, 1, 4, 8), torch.zeros(1, dtype=torch.long)
    shrunk = torch.zeros(3, 4)
    ops.sgmv_shrink(x, lora_a, shrunk, torch.tensor([0]), torch.tensor([3]), index, 1, 3, 3, 2.0)
    torch.testing.assert_close(shrunk, 2.0 * x @ lora_a[0, 0].t())
