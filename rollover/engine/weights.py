"""Write policy weights in the form vLLM's in-place reload reads.

What vLLM 0.32 needs (read from `vllm/model_executor/model_loader/reload/inplace.py` and
`default_loader.py`): `collective_rpc("reload_weights", weights_path=DIR)` points the
default loader at DIR and reads every `*.safetensors` file in it (or only those named by a
`model.safetensors.index.json`, if one is present). Tensor names are the Hugging Face
checkpoint names (`model.layers.0.self_attn.q_proj.weight`, ...); the model's own
`load_weights` maps them onto vLLM's fused layers. No config.json or tokenizer is read:
architecture, dtype and tokenizer stay those the server started with. Tied weights may be
written once (vLLM skips `lm_head.weight` when `tie_word_embeddings` is set).

Large models are written in shards of a bounded size (verl's
`checkpoint_engine.update_weights_bucket_megabytes`), named and indexed as Hugging Face
names them (`model-00001-of-00003.safetensors`, ..., and `model.safetensors.index.json`,
whose `weight_map` names each tensor's file): vLLM reads exactly the files the index names.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _state_dict(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    return model


def _dedupe_shared(
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that share storage (tied embeddings).

    safetensors refuses aliased tensors, and vLLM re-ties them itself from the config.
    """
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride())
        if t.device.type != "meta" and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into groups of at most `max_bytes` each (None: one group);
    a tensor larger than that is a group of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_weights(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Save `model`'s weights as safetensors in `out_dir`, atomically: one file, or shards of at
    most `max_shard_bytes` each with Hugging Face's index when they do not fit in one.

    The tensors are written into a fresh sibling temp folder that is then renamed to
    `out_dir`, so a reader (the engine) never sees a half-written file. An existing
    `out_dir` is replaced. The engine must see the same filesystem; a tmpfs such as
    /dev/shm makes the round trip cheapest. `dtype` casts floating tensors (e.g. to the engine's dtype, to
    halve the bytes written for a bfloat16 engine). Returns `out_dir` as an absolute path.
    """
    from safetensors.torch import save_file

    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in _dedupe_shared(_state_dict(model)).items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.to("cpu").contiguous()
    shards = _shards(tensors, max_shard_bytes)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # No fsync: the engine reads through the same page cache, so the rename alone
        # makes the files visible whole; these weights are not a crash-safe checkpoint.
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for number, part in enumerate(shards, start=1):
                file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                save_file(part, str(tmp / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(part, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        os.chmod(tmp, 0o755)
        if out.exists():
            # rename() cannot replace a non-empty folder: move the old one aside first.
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class RolloverWorkerExtension:
    """Methods added to vLLM's worker (`--worker-extension-cls`), called via collective_rpc.

    Why it exists: vLLM 0.32's in-place reload leaves a tied LM head stale on the CPU
    backend. The head shares its weight with the input embedding, so reloading the
    embedding writes the new values into that shared tensor, but the CPU backend also keeps
    a pre-packed GEMM copy of the head (built in `process_weights_after_loading`) and the
    reload never rebuilds it for a layer with no weights of its own in the checkpoint. The
    sampled tokens then come from the old head. We rebuild it after every reload. (On GPU
    nothing is packed and the rebuild is a no-op.)

    Only methods may be defined here: vLLM refuses an extension whose attribute names
    clash with the worker's, and injects this class as an extra base of its worker.
    """

    def rollover_reload_weights(self, weights_path: str) -> dict[str, object]:
        start = time.perf_counter()
        self.reload_weights(  # type: ignore[attr-defined]
            weights_path=weights_path, is_checkpoint_format=True
        )
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        embedding_weights = {
            id(getattr(m, "weight", None)) for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding"
        }
        refreshed: list[str] = []
        for name, module in model.named_modules():
            quant_method = getattr(module, "quant_method", None)
            if (
                type(module).__name__ == "ParallelLMHead"
                and id(getattr(module, "weight", None)) in embedding_weights
                and quant_method is not None
            ):
                quant_method.process_weights_after_loading(module)
                refreshed.append(name)
        return {"seconds": time.perf_counter() - start, "refreshed_tied_heads": refreshed}

    def rollover_reload_loras(self, adapters: list[Any]) -> dict[str, object]:
        """Reload LoRA adapters in place in this worker: `adapters` is `[name, int id, path]`
        per adapter, each already served under that id. vLLM's own in-place load
        (`load_inplace` on `/v1/load_lora_adapter`) leaves the flag on the request every later
        call carries, and its worker then reloads the adapter from disk at every engine step,
        and a request kept across the load reloads the old files; this swaps the weights once,
        under the id the requests already hold, so kept requests go on with the new adapter. One
        the worker evicted from its cache meanwhile is loaded again from `path`."""
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
        for name, lora_int_id, path in adapters:
            # One the worker evicted (more adapters than its cache holds) is loaded afresh:
            # from the same stable path, which holds the newest files.
            loaded = int(lora_int_id) in manager.list_adapters()
            manager.add_adapter(LoRARequest(str(name), int(lora_int_id), str(path), load_inplace=loaded))
        return {"seconds": time.perf_counter() - start, "reloaded": [name for name, _, _ in adapters]}
