"""LoRA on N ranks: FSDP2 shards the adapter with its layers, 2 ranks take the step 1 rank
takes, only the adapter moves, and its checkpoint (adapter + Adam state) loads on another
number of ranks."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import lora_worker
from tests.distributed.test_update_ranks import launch, model_dir, on_one_and_two_ranks, relative_difference

pytestmark = pytest.mark.slow  # launches of real ranks, ~10 s each

__all__ = ["model_dir"]  # the tiny policy folder, shared with test_update_ranks


@pytest.fixture(scope="module")
def lora_updates(model_dir, tmp_path_factory):
    return on_one_and_two_ranks(
        model_dir, lambda n: tmp_path_factory.mktemp(f"lora-update-{n}"), "update", worker=lora_worker
    )


def adapter_only(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if "lora_" in k}


def test_two_ranks_take_the_adapter_step_one_rank_takes(lora_updates, model_dir):
    from safetensors.torch import load_file

    initial = load_file(model_dir / "model.safetensors")
    one, two = (torch.load(lora_updates[n] / "weights.pt") for n in (1, 2))
    adapter = adapter_only(one)
    assert adapter and max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > 1e-4
    # Adam's first steps from B = 0 move each weight by about lr whatever its gradient's size, so
    # float noise in near-zero gradients shows more than in a full-weight update (1e-5 there).
    assert relative_difference(adapter, adapter_only(two)) < 1e-4
    # The base never moves (PEFT's names: base_model.model.<HF name>.base_layer.weight).
    for name, value in two.items():
        if "lora_" in name:
            continue
        hf_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(value, initial[hf_name]), name
    # The adapter the engines get, gathered from 2 shards, is the one 1 rank writes.
    written = {n: load_file(lora_updates[n] / "adapter" / "adapter_model.safetensors") for n in (1, 2)}
    assert written[1].keys() == written[2].keys() and len(written[1]) == len(adapter)
    assert relative_difference(written[1], written[2]) < 1e-4


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 1), (1, 2)])
def test_the_adapter_checkpoint_resumes_on_another_number_of_ranks(
    lora_updates, model_dir, tmp_path, saved_on, loaded_on
):
    launch(loaded_on, model_dir, tmp_path, "load", lora_updates[saved_on] / "state", worker=lora_worker)
    saved, loaded = (torch.load(d / "weights.pt") for d in (lora_updates[saved_on], tmp_path))
    assert relative_difference(adapter_only(saved), adapter_only(loaded)) < 1e-6
    moments, saved_moments = (torch.load(d / "exp_avg.pt") for d in (tmp_path, lora_updates[saved_on]))
    assert moments.keys() == saved_moments.keys() and all("lora_" in k for k in moments)
    assert relative_difference(saved_moments, moments) < 1e-6
    assert all(m.abs().sum() > 0 for m in moments.values()), "the optimizer state came back"


def test_two_policies_on_two_ranks_take_the_steps_one_rank_takes(model_dir, tmp_path_factory):
    """Each optimizer step moves one policy's adapter; on 2 ranks FSDP2 gets no gradient for the
    other adapter's shards, and the steps still equal one rank's."""
    folders = on_one_and_two_ranks(
        model_dir, lambda n: tmp_path_factory.mktemp(f"roles-{n}"), "roles", worker=lora_worker
    )
    one, two = (torch.load(folders[n] / "weights.pt") for n in (1, 2))
    for name in ("planner", "solver"):
        adapter = {k: v for k, v in adapter_only(one).items() if f".{name}." in k}
        assert adapter and max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > 1e-4, name
        assert relative_difference(adapter, {k: two[k] for k in adapter}) < 1e-4, name
    assert {p.name for p in (folders[2] / "adapter").iterdir()} == {"planner", "solver"}
