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


def auto_model_class(model_dir: str | Path) -> Any:
    """The transformers auto class for the folder's model."""
    if takes_images(model_dir):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM
