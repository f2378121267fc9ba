from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from rollover.modelzoo.warmup import read_chat_jsonl, sft_warmup, tokenize_chat

SYSTEM = "Reply with ANSWER: <number>"
QUESTIONS = ("What is {n}?", "Repeat the number {n}.", "The number is {n}. Reply with it.")


def format_task(rng: random.Random) -> tuple[list[dict], int]:
    n = rng.randint(0, 999)
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": rng.choice(QUESTIONS).format(n=n)},
        {"role": "assistant", "content": f"ANSWER: {n}"},
    ]
    return chat, n


def format_rate(model_dir: Path, k: int = 20) -> float:
    """Fraction of greedy replies that are exactly `ANSWER: <digits>`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = random.Random(1234)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on shared cores: one thread is much faster
    try:
        hits = sum(_format_ok(tok, model, rng) for _ in range(k))
    finally:
        torch.set_num_threads(threads)
    return hits / k


def _format_ok(tok, model, rng: random.Random) -> bool:
    import torch

    chat, _n = format_task(rng)
    enc = tok.apply_chat_template(chat[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    reply = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return bool(re.fullmatch(r"ANSWER: \d+", reply.strip()))


@pytest.mark.slow
def test_mask_covers_assistant_tokens_and_eos(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = [
        {"role": "user", "content": "What is 12?"},
        {"role": "assistant", "content": "ANSWER: 12"},
        {"role": "user", "content": "And 3?"},
        {"role": "assistant", "content": "ANSWER: 3"},
    ]
    ids, mask = tokenize_chat(tok, chat)
    learned = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(learned) == "ANSWER: 12<|im_end|>ANSWER: 3<|im_end|>"
    # The prompt part is exactly what the engine would see for the first reply.
    prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
    first = mask.index(1)
    assert ids[:first] == tok.encode(prompt, add_special_tokens=False)
    ids2, mask2 = tokenize_chat(tok, chat, max_length=5)
    assert len(ids2) == len(mask2) == 5


def test_read_chat_jsonl(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(chat) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    assert read_chat_jsonl(path) == [chat, chat]
    path.write_text('{"not": "messages"}\n')
    with pytest.raises(ValueError, match=":1:"):
        read_chat_jsonl(path)


@pytest.mark.slow
def test_warmup_teaches_the_format(tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(0)
    examples = [format_task(rng)[0] for _ in range(2000)]
    before = format_rate(tiny_model_dir)
    out = tmp_path / "warm"
    metrics = sft_warmup(tiny_model_dir, examples, out, steps=300, lr=3e-3, batch_size=16, seed=0, num_threads=1)
    after = format_rate(out)
    print(
        f"\nwarm-up: format rate {before:.2f} -> {after:.2f}, loss "
        f"{metrics['initial_loss']:.3f} -> {metrics['final_loss']:.3f} in {metrics['seconds']:.1f} s"
    )
    assert metrics["final_loss"] < metrics["initial_loss"] / 3
    assert after >= 0.8 and after >= before + 0.5
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "warmup_metrics.json").read_text())["steps"] == 300


@pytest.mark.slow
def test_warmup_rejects_chats_without_assistant(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="assistant"):
        sft_warmup(tiny_model_dir, [[{"role": "user", "content": "hi"}]], tmp_path / "x", steps=1)


@pytest.mark.slow
def test_a_shared_prefix_run_once_gives_the_padded_loss_and_gradient(tiny_model_dir: Path) -> None:
    """The shared-prefix path (a long common prompt run once, without gradient) computes the same
    loss as the padded batch, and the same gradient but for what flows through the prefix's keys
    and values: checked on the parameters the prefix cannot reach (the output embedding when it
    is not tied would be one; here the last layer's MLP, which the prefix's cached keys and values
    never pass through)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollover.modelzoo.warmup import _padded_loss, _shared_prefix_loss

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    system = {"role": "system", "content": SYSTEM + " " + " ".join(f"rule {k}." for k in range(40))}
    rng = random.Random(3)
    batch = [tokenize_chat(tok, [system, *format_task(rng)[0][1:]]) for _ in range(3)]
    assert len({tuple(ids[:64]) for ids, _ in batch}) == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on shared cores: one thread is much faster
    try:
        padded, padded_count = _padded_loss(model, batch, tok.pad_token_id, "cpu")
        padded.backward()
        last_mlp = model.model.layers[-1].mlp.down_proj.weight
        padded_grad = last_mlp.grad.clone()
        model.zero_grad()
        shared, shared_count = _shared_prefix_loss(model, batch, tok.pad_token_id, "cpu")
        shared.backward()
    finally:
        torch.set_num_threads(threads)
    assert int(shared_count) == int(padded_count) > 0
    assert torch.allclose(shared, padded, atol=1e-5)
    assert torch.allclose(last_mlp.grad, padded_grad, atol=1e-5)
