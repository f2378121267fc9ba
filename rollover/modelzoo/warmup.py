"""Supervised warm-up: teach a (tiny) model a task's output format before RL.

RL only learns from rewards it sees; a random-init model never produces a parseable
answer, so every reward is zero and there is nothing to learn. A few hundred steps of
next-token training on example chats, scored only on the assistant's tokens, give a
policy that sometimes succeeds. The folder written is a normal HF checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollover.jsonl import jsonl_values

Message = dict[str, Any]
# A chat to learn from: its messages, or `{"messages": [...], "tools": [...]}` when the
# transcript calls functions (the template then shows the tools, as at inference).
Chat = list[Message] | dict[str, Any]


def read_chat_jsonl(path: str | Path) -> list[Chat]:
    """Read chats from JSONL: each line is a list of messages or `{"messages": [...]}`
    (with `"tools": [...]` when its assistant calls functions)."""
    chats: list[Chat] = []
    for where, row in jsonl_values(path):
        messages = row.get("messages") if isinstance(row, dict) else row
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f'{where}: expected a list of messages or {{"messages": [...]}}')
        tools = row.get("tools") if isinstance(row, dict) else None
        chats.append({"messages": messages, "tools": tools} if tools else messages)
    return chats


def _render(
    tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool, tools: list[Any] | None = None
) -> str:
    if not messages:
        return ""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return str(text)


def tokenize_chat(
    tokenizer: Any, messages: Sequence[Message], max_length: int | None = None, tools: list[Any] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a rendered chat and a 0/1 mask that is 1 on assistant tokens.

    The learned part of each assistant turn runs up to and including the tokenizer's eos
    token (the model must learn to stop); what the template adds after it (a newline) is
    context. Prompt and response are tokenized separately, as at inference, where the
    engine tokenizes the prompt and the response is generated token by token. Needs a
    prefix-stable template (rendering the first k messages is a prefix of rendering all),
    which ChatML templates are.
    """
    eos = tokenizer.eos_token or ""
    segments: list[tuple[str, int]] = []
    consumed = ""
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if not prefix.startswith(consumed) or not full.startswith(prefix):
            raise ValueError("chat template is not prefix-stable; cannot locate assistant turns")
        reply = full[len(prefix) :]
        cut = reply.find(eos) + len(eos) if eos and eos in reply else len(reply)
        segments.append((prefix[len(consumed) :], 0))
        segments.append((reply[:cut], 1))
        consumed = prefix + reply[:cut]
    ids: list[int] = []
    mask: list[int] = []
    for text, learn in segments:
        if not text:
            continue
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [learn] * len(seg)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def sft_warmup(
    model_dir: str | Path,
    examples: Sequence[Chat],
    out_dir: str | Path,
    *,
    steps: int = 300,
    lr: float = 1e-3,
    batch_size: int = 16,
    seed: int = 0,
    max_length: int | None = 512,
    weight_decay: float = 0.0,
    warmup_steps: int = 10,
    grad_clip: float = 1.0,
    device: str = "cpu",
    log_every: int = 10,
    num_threads: int | None = None,
    shared_prefix: bool = False,
    vision_lr: float | None = None,
) -> dict[str, Any]:
    """Fine-tune `model_dir` on the assistant turns of `examples`; save to `out_dir`.

    `shared_prefix`: for chats that open with the same long prompt (a harness's system prompt
    and tools: thousands of tokens before the few learned ones), each batch is drawn from
    chats with the same first tokens, their common prefix is run once per step without
    gradient (its keys and values are the current weights', no gradient flows into them), and
    the batch's rest attends to it; logits are taken on the learned tokens only.

    Returns metrics: initial/final loss (mean over the first/last `log_every` steps),
    the loss curve (one point per `log_every` steps), seconds, token counts. Learning
    rate: linear warm-up for `warmup_steps`, then cosine decay to 10%. `num_threads` sets
    torch's CPU threads for the run (1 is far faster for a tiny model on shared cores:
    measured 8-12x on 2 busy cores, where threads wait on each other).
    """
    import torch

    if steps <= 0 or batch_size <= 0:
        raise ValueError(f"steps and batch_size must be positive, got {steps}, {batch_size}")
    if not examples:
        raise ValueError("no examples")
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _train(
            model_dir,
            examples,
            out_dir,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            seed=seed,
            max_length=max_length,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            grad_clip=grad_clip,
            device=device,
            log_every=log_every,
            shared_prefix=shared_prefix,
            vision_lr=vision_lr,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _train(
    model_dir: str | Path,
    examples: Sequence[Chat],
    out_dir: str | Path,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    max_length: int | None,
    weight_decay: float,
    warmup_steps: int,
    grad_clip: float,
    device: str,
    log_every: int,
    shared_prefix: bool = False,
    vision_lr: float | None = None,
) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from rollover.modelzoo.vl_warmup import VisionChats
    from rollover.vision.model import auto_model_class, freeze_vision_tower, in_vision_tower, takes_images

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Any: transformers' stubs type `model.to` as the unbound method (the model twice).
    model: Any = auto_model_class(model_dir).from_pretrained(str(model_dir))
    model.to(device)
    model.train()
    # A vision-language model's chats carry images: their pixels, and placeholders expanded.
    vision = VisionChats(model_dir, model) if takes_images(model_dir) else None

    if vision is not None and shared_prefix:
        raise ValueError("shared_prefix is for text chats: a vision model's chats are padded")
    data: list[Example] = []
    pixels: list[Any] = []  # a vision model's: each example's images (None: it has none)
    for chat in examples:
        messages, tools = (chat["messages"], chat.get("tools")) if isinstance(chat, dict) else (chat, None)
        ids, mask = tokenize_chat(tokenizer, messages, max_length, tools)
        images = None
        if vision is not None:
            ids, mask, images = vision.example(messages, ids, mask)
        if sum(mask) > 0:
            data.append((ids, mask))
            pixels.append(images)
    if not data:
        raise ValueError("no example has an assistant turn to learn from")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # A vision-language model's vision tower (Qwen2-VL's `visual`) at its own learning rate
    # (`vision_lr`, scaled by the same schedule; 0 freezes it).
    tower = [p for name, p in model.named_parameters() if p.requires_grad and in_vision_tower(name)]
    in_tower = {id(p) for p in tower}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_tower]
    groups = [{"params": rest, "scale": 1.0}]
    if tower:
        scale = 1.0 if vision_lr is None else vision_lr / lr
        if scale > 0:
            groups.append({"params": tower, "scale": scale})
        else:
            freeze_vision_tower(model)
    optim = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        frac = (step - warmup_steps) / max(1, steps - warmup_steps)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    order: list[int] = []
    losses: list[float] = []
    n_tokens = 0
    buckets = _buckets(data) if shared_prefix else []
    start = time.perf_counter()
    for step in range(steps):
        if shared_prefix:
            loss, count = _shared_prefix_loss(model, _draw_bucket(rng, buckets, data, batch_size), pad_id, device)
        else:
            picked = []
            for _ in range(batch_size):
                if not order:
                    order = list(range(len(data)))
                    rng.shuffle(order)
                picked.append(order.pop())
            rows = [pixels[i] for i in picked] if vision is not None else None
            loss, count = _padded_loss(model, [data[i] for i in picked], pad_id, device, vision, rows)

        for group in optim.param_groups:
            group["lr"] = lr_at(step) * group["scale"]
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optim.step()
        losses.append(float(loss.detach()))
        n_tokens += int(count)
    seconds = time.perf_counter() - start

    model.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if vision is not None:
        vision.processor.save_pretrained(str(out))
    k = max(1, min(log_every, len(losses)))
    metrics: dict[str, Any] = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "n_examples": len(data),
        "initial_loss": sum(losses[:k]) / k,
        "final_loss": sum(losses[-k:]) / k,
        "loss_curve": [sum(losses[i : i + k]) / len(losses[i : i + k]) for i in range(0, len(losses), k)],
        "n_train_tokens": n_tokens,
        "seconds": seconds,
        "train_tokens_per_second": n_tokens / seconds if seconds > 0 else 0.0,
    }
    (out / "warmup_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


Example = tuple[list[int], list[int]]  # token ids, learned-token mask
_BUCKET_KEY = 64  # chats whose first this many tokens agree share a bucket


def _padded(batch: Sequence[Example], pad_id: int, device: str):  # -> (ids, attention, learn) tensors
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    learn = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (ids, m) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        learn[row, : len(ids)] = torch.tensor(m, dtype=torch.bool)
    return input_ids.to(device), attention.to(device), learn.to(device)


def _padded_loss(
    model: Any, batch: Sequence[Example], pad_id: int, device: str, vision: Any = None, images: Any = None
):  # -> (loss, count)
    """The batch's mean next-token loss on its learned tokens, right-padded; a vision model's
    (`vision`: `vl_warmup.VisionChats`) with each row's `images`."""
    import torch

    input_ids, attention, learn = _padded(batch, pad_id, device)
    if vision is None:
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    else:
        logits = vision.logits(input_ids, attention, images)[:, :-1].float()
    targets = input_ids[:, 1:]
    target_mask = learn[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    count = target_mask.sum().clamp(min=1)
    return (nll * target_mask).sum() / count, count


def _buckets(data: Sequence[Example]) -> list[list[int]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (ids, _) in enumerate(data):
        groups.setdefault(tuple(ids[:_BUCKET_KEY]), []).append(index)
    return list(groups.values())


def _draw_bucket(rng: random.Random, buckets: list[list[int]], data: Sequence[Example], size: int) -> list[Example]:
    """`size` examples of one bucket, the bucket picked in proportion to its size."""
    bucket = rng.choices(buckets, weights=[len(b) for b in buckets])[0]
    return [data[rng.choice(bucket)] for _ in range(size)]


def _shared_prefix_loss(model: Any, batch: Sequence[Example], pad_id: int, device: str):  # -> (loss, count)
    """The batch's mean next-token loss on its learned tokens, its common prefix (up to the
    token before the first learned one) run once without gradient."""
    import torch

    first = batch[0][0]
    limit = min(min(m.index(1) if 1 in m else len(m) for _, m in batch) - 1, min(len(ids) for ids, _ in batch) - 1)
    shared = 0
    while shared < limit and all(ids[shared] == first[shared] for ids, _ in batch):
        shared += 1
    cache = None
    if shared > 0:
        with torch.no_grad():
            prefix = torch.tensor([first[:shared]], dtype=torch.long, device=device)
            cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
    rest = [(ids[shared:], m[shared:]) for ids, m in batch]
    input_ids, attention, learn = _padded(rest, pad_id, device)
    attention = torch.cat([torch.ones((len(batch), shared), dtype=attention.dtype, device=device), attention], 1)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention, past_key_values=cache).last_hidden_state
    target_mask = learn[:, 1:]
    logits = model.get_output_embeddings()(hidden[:, :-1][target_mask]).float()
    nll = torch.nn.functional.cross_entropy(logits, input_ids[:, 1:][target_mask], reduction="sum")
    count = target_mask.sum().clamp(min=1)
    return nll / count, count
