from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.engine.weights import WEIGHTS_FILE, save_weights


@pytest.mark.slow
def test_save_weights_writes_one_safetensors_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    out = save_weights(model, tmp_path / "w")
    assert out.is_absolute() and [p.name for p in out.iterdir()] == [WEIGHTS_FILE]
    tensors = load_file(str(out / WEIGHTS_FILE))
    # Tied head written once, under the embedding's name (vLLM re-ties it itself).
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    for name, value in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(tensors[name], value), name


def test_save_weights_replaces_atomically_and_casts(tmp_path: Path) -> None:
    out = tmp_path / "w"
    save_weights({"a": torch.ones(3), "n": torch.arange(3)}, out)
    save_weights({"a": torch.zeros(3), "n": torch.arange(3)}, out, dtype=torch.bfloat16)
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert tensors["a"].dtype == torch.bfloat16 and not tensors["a"].any()
    assert tensors["n"].dtype == torch.int64  # only floating tensors are cast
    # No temp or old folders are left beside it.
    assert sorted(os.listdir(tmp_path)) == ["w"]


def test_failed_save_leaves_previous_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "w"
    save_weights({"a": torch.ones(2)}, out)
    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_weights({"a": torch.zeros(2)}, out)
    assert torch.equal(load_file(str(out / WEIGHTS_FILE))["a"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["w"]
