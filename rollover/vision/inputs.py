"""A vision-language model's inputs, built as the model's own code builds them.

- `load_image_processor`: the model's image processor, from its folder; the backend that needs
  no torchvision (the same resize and normalisation as the engine's).
- `pixel_inputs`: images (their bytes, as recorded) into `pixel_values` (every image's patches
  in order) and `image_grid_thw` (each image's patch grid), and how many tokens each image is
  in the prompt (its grid over the merge size squared): the engine expanded each image's
  placeholder into exactly that many.
- `position_ids`: Qwen2-VL's 3-D mRoPE positions (time, height, width) of a right-padded batch,
  from the model's own `get_rope_index`: text tokens count up, an image's tokens take its grid
  coordinates, and the text after an image resumes past its largest coordinate.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def load_image_processor(model_dir: str | Path) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")


@dataclass(frozen=True)
class PixelInputs:
    """The images of one batch, in the order their placeholders appear row by row."""

    pixel_values: torch.Tensor  # [patches, channels * temporal * patch * patch]
    image_grid_thw: torch.Tensor  # [images, 3] long
    tokens: tuple[int, ...]  # each image's placeholder tokens in the prompt

    def to(self, device: torch.device) -> PixelInputs:
        return PixelInputs(self.pixel_values.to(device), self.image_grid_thw.to(device), self.tokens)


def pixel_inputs(processor: Any, images: Sequence[bytes]) -> PixelInputs:
    """`images` through the model's image processor (decoded as RGB, as the engine does)."""
    from PIL import Image

    decoded = []
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            decoded.append(image.convert("RGB"))
    out = processor(images=decoded, return_tensors="pt")
    grid = out["image_grid_thw"].long()
    merge = int(getattr(processor, "merge_size", 1))
    tokens = tuple(int(t) for t in (grid.prod(dim=-1) // (merge * merge)).tolist())
    return PixelInputs(out["pixel_values"].float(), grid, tokens)


def concatenated(parts: Sequence[PixelInputs]) -> PixelInputs | None:
    """Several rows' images as one batch's, in row order (None: no image at all)."""
    parts = [p for p in parts if p.tokens]
    if not parts:
        return None
    return PixelInputs(
        torch.cat([p.pixel_values for p in parts]),
        torch.cat([p.image_grid_thw for p in parts]),
        tuple(t for p in parts for t in p.tokens),
    )


def image_runs(input_ids: Sequence[int], image_token_id: int) -> list[int]:
    """The lengths of the runs of image placeholder tokens in a sequence, in order: one run per
    image, as the engine expanded it."""
    runs: list[int] = []
    previous = None
    for token in input_ids:
        if token == image_token_id:
            if previous == image_token_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = token
    return runs


def expand_placeholders(input_ids: Sequence[int], image_token_id: int, tokens: Sequence[int]) -> list[int]:
    """A prompt with one placeholder per image (as a chat template writes it) expanded to each
    image's tokens, as the model's processor (and the engine) expands it."""
    counts = iter(tokens)
    out: list[int] = []
    for token in input_ids:
        out.extend([token] * next(counts) if token == image_token_id else [token])
    if next(counts, None) is not None:
        raise ValueError("more images than image placeholders in the prompt")
    return out


def rope_index_owner(model: torch.nn.Module) -> Any:
    """The module of `model` (wrapped by PEFT or FSDP or not) that computes mRoPE positions."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    raise ValueError("the model has no get_rope_index: it is not a Qwen2-VL-style model")


def position_ids(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
) -> torch.Tensor:
    """`[3, B, L]` mRoPE positions of a right-padded batch (padding at 0), by the model's own
    `get_rope_index`; a batch with no image gets the same positions on the three axes."""
    owner = rope_index_owner(model)
    token_types = (input_ids == image_token_id).to(torch.int32)
    positions, _ = owner.get_rope_index(
        input_ids, mm_token_type_ids=token_types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
    )
    return positions
