"""LoRA (verl's `actor_rollout_ref.model.lora_rank` > 0): the actor is a PEFT adapter over
frozen base weights. Only the adapter is trained, checkpointed and sent to the engines; the
base never moves, and with the adapter disabled it is the KL reference.

The adapter is written in PEFT's own format (`adapter_config.json` and
`adapter_model.safetensors`, names without the adapter's name), which vLLM's runtime LoRA
loading and `PeftModel.from_pretrained` both read.

Several policies (`agentlightning.policies`) are several adapters in the one PEFT model, each
under its policy's name; one is active at a time (`activate`), and the adapter folder holds a
PEFT folder per policy (`<folder>/<policy>/`). One policy is PEFT's adapter "default", written
in the folder itself.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rollover.adapter_folder import ADAPTER_WEIGHTS
from rollover.config import ConfigError
from rollover.distributed import sharding
from rollover.training.update_settings import LoraSettings

SINGLE = "default"  # PEFT's name for a model's only adapter


def adapter_names(policies: Sequence[str]) -> list[str]:
    """The PEFT adapters of a run: one per policy, else PEFT's single "default"."""
    return list(policies) or [SINGLE]


# A vision-language model's vision tower (Qwen2-VL's `model.visual`), matched by PEFT's fullmatch.
VISION_TOWER = r".*\bvisual(\..*)?"


def without_vision_tower(model: torch.nn.Module, exclude: str | list[str] | None) -> str | list[str] | None:
    """`exclude_modules` widened, for a vision-language model, to its whole vision tower: the
    adapter trains the language model only (the engine serves LoRA on the language model)."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return exclude
    if exclude is None:
        return VISION_TOWER
    # PEFT reads a list as module names (a name or a dotted suffix), a string as a regex.
    given = exclude if isinstance(exclude, str) else "|".join(rf"(.*\.)?{re.escape(name)}" for name in exclude)
    return f"(?:{given})|(?:{VISION_TOWER})"


def wrap(
    model: torch.nn.Module, settings: LoraSettings, base_path: str | Path, *, seed: int, policies: Sequence[str] = ()
) -> Any:  # -> PeftModel
    """`model` with a trainable LoRA adapter (the one at `lora_adapter_path`, else a fresh one
    drawn from `seed`, whose B matrices are zero: at first the policy is the base model), base
    weights frozen; with `policies`, one fresh adapter per policy (each drawn from its own
    seed), every one trainable."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if settings.adapter_path is not None:
        wrapped = PeftModel.from_pretrained(model, settings.adapter_path, is_trainable=True)
        rank = getattr(wrapped.peft_config["default"], "r", None)
        if rank != settings.rank:
            raise ConfigError(
                f"config key 'actor_rollout_ref.model.lora_rank': {settings.rank} is not the rank of the adapter "
                f"at actor_rollout_ref.model.lora_adapter_path ({rank}); set it to {rank}"
            )
    else:
        lora = LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            target_modules=settings.target_modules
            if isinstance(settings.target_modules, str)
            else list(settings.target_modules),
            exclude_modules=without_vision_tower(
                model,
                settings.exclude_modules
                if settings.exclude_modules is None or isinstance(settings.exclude_modules, str)
                else list(settings.exclude_modules),
            ),
            lora_dropout=0.0,  # the trainer's logprobs must be the engine's
            bias="none",
            task_type="CAUSAL_LM",
        )
        # Every rank draws the same A (FSDP2 shards what each rank holds), and a run draws the
        # same on any number of ranks; the caller's random state is left as it was.
        names = adapter_names(policies)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = get_peft_model(model, lora, adapter_name=names[0])
            for offset, name in enumerate(names[1:], start=1):
                torch.manual_seed(seed + offset)
                wrapped.add_adapter(name, copy.deepcopy(lora))
        activate(wrapped, names[0])
    # The adapter's config names its base: `rollover model merge` finds it there.
    for adapter_config in wrapped.peft_config.values():
        adapter_config.base_model_name_or_path = str(Path(base_path).absolute())
    return wrapped


def activate(model: Any, name: str) -> None:
    """Make `name` the adapter the model's forward passes go through. PEFT's `set_adapter`
    also freezes the other adapters; every adapter stays trainable here (the optimizer and
    FSDP2 were built over all of them: one not in the forward simply gets no gradient)."""
    model.set_adapter(name)
    for parameter_name, parameter in model.named_parameters():
        if "lora_" in parameter_name:
            parameter.requires_grad_(True)


def named_adapter_parameters(model: torch.nn.Module, name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters of adapter `name`, by name (PEFT names them
    `...lora_A.<name>.weight`): not the frozen base, not the other adapters."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and f".{name}." in n]


def adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    return [p for _, p in named_adapter_parameters(model, name)]


class SavedNames:
    """What `adapter_state_dict` learnt of PEFT's saved names for one model (its `Actor`
    holds one), by adapter and the names of its parameters: {parameter name: saved name}, or
    None where PEFT's state is not a renaming."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, tuple[str, ...]], dict[str, str] | None] = {}


def adapter_state_dict(
    model: torch.nn.Module, *, keep: bool, name: str = SINGLE, names: SavedNames | None = None
) -> dict[str, torch.Tensor]:
    """Adapter `name`'s weights whole, on the host, under PEFT's saved names (a collective on
    several ranks: every rank takes part in the gathers; those without `keep` get `{}`).
    `names`: the model's renaming as learnt by earlier saves (asked of PEFT every time without)."""
    from peft import get_peft_model_state_dict

    gathered: dict[str, torch.Tensor] = {}
    for parameter_name, parameter in named_adapter_parameters(model, name):
        whole = sharding.full_tensor(parameter.detach())
        if keep:
            gathered[parameter_name] = whole.to("cpu", copy=True)
    if not keep:
        return {}
    known = (names or SavedNames()).known
    layout = (name, tuple(gathered))
    if layout in known and (saved_names := known[layout]) is not None:
        return {saved: gathered[parameter_name] for parameter_name, saved in saved_names.items()}
    state = dict(get_peft_model_state_dict(model, state_dict=gathered, adapter_name=name))
    # PEFT's state is the gathered tensors renamed (`...lora_A.<name>.weight` saved as
    # `...lora_A.weight`): that renaming is kept for the next save of the same parameters.
    # PEFT works it out by walking the whole model and reading the base model's config from
    # disk (45 of the 120 ms a SmolLM2 adapter's save took), and it never changes in a run.
    # A state that is anything else (tensors PEFT added or changed) is asked of PEFT every time.
    by_identity = {id(tensor): parameter_name for parameter_name, tensor in gathered.items()}
    renamed = len(state) == len(gathered) and {id(tensor) for tensor in state.values()} == by_identity.keys()
    known[layout] = {by_identity[id(tensor)]: saved for saved, tensor in state.items()} if renamed else None
    return state


def write_adapter(state: Mapping[str, torch.Tensor], model: Any, directory: str | Path, name: str = SINGLE) -> Path:
    """`state` (from `adapter_state_dict`) and adapter `name`'s config as a PEFT adapter
    folder, atomically (a fresh sibling folder renamed into place: a reader never sees half of
    one; an existing folder is replaced). Returns the folder, absolute."""
    from safetensors.torch import save_file

    out = Path(directory).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tensors = {name: t.contiguous() for name, t in state.items()}
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        model.peft_config[name].save_pretrained(str(tmp))
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merge(adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The base model (the one the adapter's config names) with the adapter merged into its
    weights, saved as a plain Hugging Face model folder (tokenizer too) that loads without PEFT."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoTokenizer

    from rollover.vision.model import auto_model_class

    adapter_dir = Path(adapter_dir)
    base = PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"the adapter at {adapter_dir} names base model {base!r}, which is not a model folder")
    model = auto_model_class(base).from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer_from = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else Path(base)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return out
