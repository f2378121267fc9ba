"""Supervised warm-up of a vision-language model (the tiny Qwen2-VL) on chats with images, as
`warmup.sft_warmup` warms a text model up: next-token training on the assistant's tokens only.

A chat's images are OpenAI `image_url` parts with data: URLs, as an agent sends them. The chat
is rendered by the model's template (one placeholder per image), each placeholder expanded to
its image's tokens as the engine expands it, and the images go through the model's own image
processor, the positions through its own mRoPE: the inputs the engine and the trainer build.
"""

from __future__ import annotations

import base64
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollover.modelzoo.warmup import tokenize_chat
from rollover.vision.inputs import PixelInputs, concatenated, expand_placeholders, load_image_processor, pixel_inputs
from rollover.vision.inputs import position_ids as mrope_positions

Chat = list[dict[str, Any]]


def chat_images(chat: Chat) -> list[bytes]:
    """The chat's images, in order (data: URLs of `image_url` parts)."""
    found = []
    for message in chat:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = str((part.get("image_url") or {}).get("url", ""))
                found.append(base64.b64decode(url.partition(",")[2]))
    return found


def vl_warmup(
    model_dir: str | Path,
    chats: Sequence[Chat],
    out_dir: str | Path,
    *,
    steps: int = 600,
    lr: float = 3e-3,
    batch_size: int = 16,
    seed: int = 0,
    warmup_steps: int = 10,
    grad_clip: float = 1.0,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Fine-tune the model in `model_dir` on the assistant turns of `chats`; save to `out_dir`
    (with its tokenizer and image processor). Linear warm-up, then cosine decay to 10%."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        processor = load_image_processor(model_dir)
        model: Any = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
        model.train()
        image_id = int(model.config.image_token_id)
        data: list[tuple[list[int], list[int], PixelInputs | None]] = []
        for chat in chats:
            ids, mask = tokenize_chat(tokenizer, chat)
            images = chat_images(chat)
            pixels = pixel_inputs(processor, images) if images else None
            if pixels is not None:
                counts = iter(pixels.tokens)
                expanded_mask: list[int] = []
                for token, learned in zip(ids, mask):
                    expanded_mask += [learned] * (next(counts) if token == image_id else 1)
                ids, mask = expand_placeholders(ids, image_id, pixels.tokens), expanded_mask
            data.append((ids, mask, pixels))
        pad = tokenizer.pad_token_id or 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

        def lr_at(step: int) -> float:
            if step < warmup_steps:
                return lr * (step + 1) / warmup_steps
            frac = (step - warmup_steps) / max(1, steps - warmup_steps)
            return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

        order: list[int] = []
        losses: list[float] = []
        started = time.perf_counter()
        for step in range(steps):
            batch = []
            for _ in range(batch_size):
                if not order:
                    order = list(range(len(data)))
                    rng.shuffle(order)
                batch.append(data[order.pop()])
            width = max(len(ids) for ids, _, _ in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            learn = torch.zeros((len(batch), width), dtype=torch.bool)
            for row, (ids, mask, _) in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention[row, : len(ids)] = 1
                learn[row, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
            pixels = concatenated([p for _, _, p in batch if p is not None])
            grid = None if pixels is None else pixels.image_grid_thw
            logits = model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=mrope_positions(model, input_ids, attention, grid, image_id),
                pixel_values=None if pixels is None else pixels.pixel_values,
                image_grid_thw=grid,
                use_cache=False,
            ).logits[:, :-1]
            targets, target_mask = input_ids[:, 1:], learn[:, 1:]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
            ).view_as(targets)
            loss = (nll * target_mask).sum() / target_mask.sum().clamp(min=1)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(previous_threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    for name in ("preprocessor_config.json", "rollover_model.json", "generation_config.json"):
        source = Path(model_dir) / name
        if source.exists():
            (out / name).write_text(source.read_text())
    k = max(1, min(10, len(losses)))
    metrics = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "n_examples": len(data),
        "initial_loss": sum(losses[:k]) / k,
        "final_loss": sum(losses[-k:]) / k,
        "seconds": seconds,
    }
    (out / "warmup_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
