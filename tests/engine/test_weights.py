from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollover.engine.weights import INDEX_FILE, WEIGHTS_FILE, save_weights


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


def read_back(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder, by the index when there is one (as vLLM reads it)."""
    index = folder / INDEX_FILE
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {WEIGHTS_FILE}
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(files):
        part = load_file(str(folder / file))
        assert not tensors.keys() & part.keys(), "a tensor is in two files"
        tensors.update(part)
    return tensors


def test_weights_are_sharded_by_size_with_hugging_faces_index(tmp_path: Path) -> None:
    state = {
        "a": torch.arange(100, dtype=torch.float32),  # 400 bytes
        "b": torch.ones(100),  # 400: fits beside a in 1000
        "big": torch.full((1000,), 2.0),  # 4000: over the bucket, a file of its own
        "c": torch.zeros(50, dtype=torch.float64),  # 400
        "n": torch.arange(25),  # 200 (int64): fits beside c
        "d": torch.ones(200),  # 800: the next file
    }
    out = save_weights(state, tmp_path / "w", max_shard_bytes=1000)
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, INDEX_FILE])
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["weight_map"] == {
        "a": shards[0],
        "b": shards[0],
        "big": shards[1],
        "c": shards[2],
        "n": shards[2],
        "d": shards[3],
    }
    assert index["metadata"]["total_size"] == 400 + 400 + 4000 + 400 + 200 + 800
    assert [sorted(load_file(str(out / shard))) for shard in shards] == [["a", "b"], ["big"], ["c", "n"], ["d"]]
    tensors = read_back(out)
    assert tensors.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(tensors[name], value) and tensors[name].dtype == value.dtype, name


def test_weights_that_fit_the_bucket_are_one_file(tmp_path: Path) -> None:
    out = save_weights({"a": torch.ones(100), "b": torch.ones(100)}, tmp_path / "w", max_shard_bytes=800)
    assert [p.name for p in out.iterdir()] == [WEIGHTS_FILE]
    # sharded again over a folder that held one file: no stale file is left to be read
    out = save_weights({"a": torch.ones(100), "b": torch.ones(100)}, out, max_shard_bytes=799)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [INDEX_FILE, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )


class _Gathered:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]:
        return dict(self.state)


class _Engine:
    """What the weight sync asks of an engine; records the folder it was told to read."""

    device = "cpu"

    def __init__(self) -> None:
        self.loaded: list[tuple[Path, int]] = []

    async def load_weights(self, weights_dir: Path, *, version: int) -> int:
        self.loaded.append((weights_dir, version))
        return version


def test_the_weight_sync_writes_buckets_of_the_configured_megabytes(tmp_path: Path) -> None:
    from rollover.config import load_config
    from rollover.engine.weight_sync import EngineWeightSync

    key = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
    bucket = load_config(None, [f"{key}=1"]).actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
    mib = 1 << 20
    state = {  # 0.75 MiB each: two do not fit in 1 MiB; 3 MiB alone
        "x": torch.zeros(3 * mib // 16),
        "y": torch.ones(3 * mib // 16),
        "huge": torch.ones(3 * mib // 4),
    }
    engine = _Engine()
    sync = EngineWeightSync([engine], tmp_path / "weights", bucket_megabytes=bucket)  # type: ignore[list-item]
    asyncio.run(sync.sync(_Gathered(state), version=3))
    [(folder, version)] = engine.loaded
    assert version == 3 and folder == tmp_path / "weights" / "v3"
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 3  # x, y and huge each in a file of its own
    assert {name: value.shape for name, value in read_back(folder).items()} == {k: v.shape for k, v in state.items()}
    # the default bucket (2048 MiB) holds it all in one file
    default = load_config(None).actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
    engine = _Engine()
    sync = EngineWeightSync([engine], tmp_path / "w2", bucket_megabytes=default)  # type: ignore[list-item]
    asyncio.run(sync.sync(_Gathered(state), version=4))
    assert [p.name for p in engine.loaded[0][0].iterdir()] == [WEIGHTS_FILE]
