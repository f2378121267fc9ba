from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollover.modelzoo.tiny import CHAT_TEMPLATE, IM_END, IM_START, PAD_TOKEN, build_tiny_model


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.slow
def test_folder_has_hf_files(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 128
    assert config["dtype"] == "float32"
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    # Nothing but stop/pad ids: vLLM would copy sampling defaults from this file.
    assert set(gen) - {"eos_token_id", "pad_token_id", "bos_token_id", "transformers_version"} == set()


@pytest.mark.slow
def test_tokenizer_round_trips(tok) -> None:
    for text in ["What is 12345 + 6789?", "ANSWER: 42\n", "café naïve — ok", "  spaces\tand\ttabs  "]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow
def test_tokenizer_json_agrees_with_auto_tokenizer(tiny_model_dir: Path, tok) -> None:
    # transformers swaps in its own Qwen2 pipeline on load; ours must split identically.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = 'Sum 123 and 4567, then it\'s <tool_call>{"x": 1}</tool_call>\n\nDone.'
    assert raw.encode(text).ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_digits_are_single_tokens(tok) -> None:
    text = "The result of 9876543210 * 12 is 118518518520 (x=07)."
    for piece in tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)):
        if any(ch.isdigit() for ch in piece):
            assert len(piece) == 1, piece
    assert tok.encode("31415", add_special_tokens=False) == [tok.convert_tokens_to_ids(d) for d in "31415"]


@pytest.mark.slow
def test_special_tokens(tok) -> None:
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    for t in (IM_START, IM_END, PAD_TOKEN):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


@pytest.mark.slow
def test_chat_template(tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": [{"type": "text", "text": "ANSWER: 5"}]},
    ]
    # the template as built today (a cached test model may carry an older copy)
    text = tok.apply_chat_template(messages, tokenize=False, chat_template=CHAT_TEMPLATE)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "2+3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n5<|im_end|>\n"
        "<|im_start|>assistant\nANSWER: 5<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[:2], tokenize=False).endswith("<|im_end|>\n")


@pytest.mark.slow
def test_model_loads_and_runs(tiny_model_dir: Path, tok) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.dtype == torch.float32
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_build_is_deterministic_and_configurable(tmp_path: Path) -> None:
    a = build_tiny_model(
        tmp_path / "a",
        arch="llama",
        vocab_size=400,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        corpus=["zebra " * 20] * 100,
        seed=3,
    )
    b = build_tiny_model(
        tmp_path / "b",
        arch="llama",
        vocab_size=400,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        corpus=["zebra " * 20] * 100,
        seed=3,
    )
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 400
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    assert tok.tokenize("zebra") == ["zebra"]  # the extra corpus shapes the merges


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_model(tmp_path / "x", hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "y", arch="gpt2")  # type: ignore[arg-type]
