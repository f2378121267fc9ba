"""What a model folder says about images, and the transformers class that loads it: a
vision-language model (its config has a `vision_config`) loads as the image-text-to-text model
its config names (Qwen2-VL's `Qwen2VLForConditionalGeneration`), a text model as a causal LM.
Torch-free to import: the engine and the launcher ask `takes_images` too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def takes_images(model_dir: str | Path) -> bool:
    """Whether the model folder is a vision-language model's (its config has a vision tower)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def in_vision_tower(name: str) -> bool:
    """Whether the parameter named `name` (in the model) is the vision tower's (Qwen2-VL's
    `visual`, its patch merger included)."""
    return ".visual." in f".{name}"


def freeze_vision_tower(model: Any) -> int:
    """Stop training the model's vision tower (`actor_rollout_ref.model.freeze_vision_tower`):
    its parameters need no gradient and get no optimizer state. Returns how many were frozen;
    a model with none (a text model) is refused, since the key would then mean nothing."""
    frozen = 0
    for name, parameter in model.named_parameters():
        if in_vision_tower(name):
            parameter.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise ValueError(
            "actor_rollout_ref.model.freeze_vision_tower is set but the model has no vision tower (a text model)"
        )
    return frozen


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def copy_processor(model_dir: str | Path, out_dir: str | Path) -> None:
    """The model folder's image processor settings into a folder the model is saved to (a
    checkpoint, the final model): a run resumed or served from there reads images the same way."""
    import shutil

    for name in PROCESSOR_FILES:
        source = Path(model_dir) / name
        if source.is_file() and source.resolve() != (Path(out_dir) / name).resolve():
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, Path(out_dir) / name)


def auto_model_class(model_dir: str | Path) -> Any:
    """The transformers auto class for the folder's model."""
    if takes_images(model_dir):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM
