"""What the supervised warm-up (`warmup.sft_warmup`) does differently for a vision-language model
(the tiny Qwen2-VL): its chats carry images as OpenAI `image_url` parts with data: URLs, as an
agent sends them.

The chat is rendered by the model's template (one placeholder per image) and tokenized as any
chat; each placeholder is then expanded to its image's tokens as the engine expands it, the
images go through the model's own image processor and the positions through its own mRoPE:
the inputs the engine and the trainer build.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rollover.vision.inputs import (
    PixelInputs,
    concatenated,
    expand_placeholders,
    load_image_processor,
    pixel_inputs,
    position_ids,
)


def chat_images(messages: Sequence[dict[str, Any]]) -> list[bytes]:
    """The chat's images, in order (data: URLs of `image_url` parts)."""
    found = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = str((part.get("image_url") or {}).get("url", ""))
                found.append(base64.b64decode(url.partition(",")[2]))
    return found


class VisionChats:
    """The model's image processor and image token, for the warm-up's examples and passes."""

    def __init__(self, model_dir: str | Path, model: Any) -> None:
        self.model = model
        self.processor = load_image_processor(model_dir)
        self.image_token_id = int(json.loads((Path(model_dir) / "config.json").read_text())["image_token_id"])

    def example(
        self, messages: Sequence[dict[str, Any]], ids: list[int], mask: list[int]
    ) -> tuple[list[int], list[int], PixelInputs | None]:
        """A tokenized chat (one placeholder per image) with each placeholder expanded to its
        image's tokens (never learned), and the images' pixels."""
        images = chat_images(messages)
        if not images:
            return ids, mask, None
        pixels = pixel_inputs(self.processor, images)
        counts = iter(pixels.tokens)
        expanded_mask: list[int] = []
        for token, learned in zip(ids, mask):
            expanded_mask += [learned] * (next(counts) if token == self.image_token_id else 1)
        return expand_placeholders(ids, self.image_token_id, pixels.tokens), expanded_mask, pixels

    def logits(
        self, input_ids: torch.Tensor, attention: torch.Tensor, rows: Sequence[PixelInputs | None]
    ) -> torch.Tensor:
        """One forward pass of a right-padded batch, every row's images in row order."""
        pixels = concatenated([p for p in rows if p is not None])
        device = input_ids.device
        grid = None if pixels is None else pixels.image_grid_thw.to(device)
        logits: torch.Tensor = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=position_ids(self.model, input_ids, attention, grid, self.image_token_id),
            pixel_values=None if pixels is None else pixels.pixel_values.to(device),
            image_grid_thw=grid,
            use_cache=False,
        ).logits
        return logits
