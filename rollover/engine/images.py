"""How many images a served model takes per prompt, and the vLLM flags that say so.

A model folder whose config has a `vision_config` is a vision-language model. Its engine is
started with `--limit-mm-per-prompt {"image": N, "video": 0}` (videos would need torchvision,
which the CPU install leaves out) and registers N with the gateway, which refuses a call with
more images, or with any image for a text-only model (N = 0), with a 400 naming the limit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rollover.vision.model import takes_images

LIMIT_FLAG = "--limit-mm-per-prompt"
DEFAULT_IMAGES_PER_PROMPT = 4


def image_limit(model_dir: str | Path, limit: int | None, extra_args: Sequence[str]) -> tuple[int, list[str]]:
    """Images per prompt the engine takes and the flags to add for it: 0 and none for a
    text-only model; else `limit` (None: `DEFAULT_IMAGES_PER_PROMPT`), or the image count an
    explicit `--limit-mm-per-prompt` among `extra_args` gives (then no flag is added)."""
    if not takes_images(model_dir):
        return 0, []
    args = list(extra_args)
    if LIMIT_FLAG in args:
        position = args.index(LIMIT_FLAG)
        given = args[position + 1] if position + 1 < len(args) else ""
        try:
            images = json.loads(given).get("image", 0)
        except (ValueError, AttributeError):
            raise ValueError(f"{LIMIT_FLAG} must be a JSON object such as '{{\"image\": 2}}', got {given!r}") from None
        return int(images), []
    count = DEFAULT_IMAGES_PER_PROMPT if limit is None else limit
    if count < 0:
        raise ValueError(f"images per prompt must be at least 0, got {count}")
    return count, [LIMIT_FLAG, json.dumps({"image": count, "video": 0})]
