"""A tiny random-init causal LM with a locally trained tokenizer.

Nothing is downloaded: the tokenizer is trained on a built-in corpus (plus an optional
one) and the weights are random. The folder is a normal Hugging Face checkpoint that
both `transformers` and vLLM load, which is what tests and CI need.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from rollover.modelzoo.chat_template import chatml_template

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# ChatML, the same shape Qwen2 and SmolLM2 use, with tools and tool calls (see chat_template).
CHAT_TEMPLATE = chatml_template()

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "at",
    "by",
    "from",
    "be",
    "this",
    "are",
    "was",
    "or",
    "not",
    "what",
    "how",
    "many",
    "much",
    "total",
    "sum",
    "difference",
    "product",
    "quotient",
    "result",
    "answer",
    "question",
    "number",
    "numbers",
    "plus",
    "minus",
    "times",
    "divided",
    "add",
    "subtract",
    "multiply",
    "divide",
    "equals",
    "equal",
    "apples",
    "oranges",
    "books",
    "coins",
    "cars",
    "boxes",
    "students",
    "days",
    "hours",
    "minutes",
    "dollars",
    "cents",
    "has",
    "have",
    "had",
    "buys",
    "sells",
    "gives",
    "gets",
    "left",
    "more",
    "less",
    "each",
    "every",
    "per",
    "remaining",
    "calculate",
    "calculator",
    "tool",
    "call",
    "use",
    "compute",
    "expression",
    "value",
    "final",
    "think",
    "step",
    "first",
    "then",
    "next",
    "so",
    "therefore",
    "because",
    "if",
    "else",
    "yes",
    "no",
    "true",
    "false",
    "error",
    "you",
    "are",
    "helpful",
    "assistant",
    "user",
    "system",
    "reply",
    "only",
    "with",
    "format",
    "please",
    "file",
    "test",
    "tests",
    "pass",
    "fail",
    "fix",
    "bug",
    "code",
    "function",
    "return",
    "import",
    "def",
    "class",
    "look",
    "go",
    "take",
    "open",
    "move",
    "room",
    "door",
    "north",
    "south",
    "east",
    "west",
    "inventory",
]

_TOOL_NAMES = ("calculator", "python", "search", "read_file", "write_file", "run_tests")


def _builtin_corpus(seed: int, n_lines: int = 4000) -> Iterator[str]:
    """Text the tokenizer is trained on: it fixes which merges exist, nothing else."""
    rng = random.Random(seed)
    yield "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , : ; ? ! ' \" { } [ ] < > _ # % $ @ & | \\ ~ ^"
    yield " ".join(_WORDS)
    yield " ".join(w.capitalize() for w in _WORDS)
    yield " ".join(w.upper() for w in _WORDS)
    for _ in range(n_lines):
        kind = rng.randrange(5)
        a, b = rng.randint(0, 9999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        if kind == 0:
            yield f"{a} {op} {b} = ?"
        elif kind == 1:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
            yield f"{words.capitalize()} {a}?"
        elif kind == 2:
            yield f"ANSWER: {a}\nThe answer is {b}."
        elif kind == 3:
            role = rng.choice(("system", "user", "assistant", "tool"))
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
            yield f"{IM_START}{role}\n{words}{IM_END}\n"
        else:
            tool = rng.choice(_TOOL_NAMES)
            yield (f'<tool_call>\n{{"name": "{tool}", "arguments": {{"expression": "{a}{op}{b}"}}}}\n</tool_call>')


def _train_tokenizer(corpus: Iterable[str], vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    # The same pipeline transformers' Qwen2Tokenizer rebuilds on load (AutoTokenizer
    # forces that class for model_type qwen2 and ignores tokenizer.json's pipeline), so
    # tokenizer.json, transformers and vLLM all split text identically. Its regex makes
    # every digit its own pre-token: no merge can join digits, each digit is one token.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tiny_tokenizer(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
    model_max_length: int = 2048,
):  # -> transformers.PreTrainedTokenizerFast
    """Train and save the tokenizer alone; `build_tiny_model` calls this."""
    from transformers import PreTrainedTokenizerFast

    def lines() -> Iterator[str]:
        yield from _builtin_corpus(seed)
        if corpus is not None:
            yield from corpus

    raw = _train_tokenizer(lines(), vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random-init float32 causal LM and its tokenizer to `out_dir`.

    The result loads with `AutoModelForCausalLM`/`AutoTokenizer` and serves with vLLM.
    `vocab_size` is the tokenizer's target; the model's vocabulary is the trained size.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if vocab_size < 300:
        # Below 256 bytes + specials + a few merges the tokenizer cannot cover the bytes.
        raise ValueError(f"vocab_size={vocab_size} is too small (need >= 300)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tiny_tokenizer(
        out,
        vocab_size=vocab_size,
        corpus=corpus,
        seed=seed,
        model_max_length=max_position_embeddings,
    )
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    # Grouped-query attention when possible, so the tiny model exercises the same
    # attention path (separate k/v head count) as real models.
    kv_heads = num_heads // 2 if num_heads % 2 == 0 else num_heads
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    config.dtype = torch.float32

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Only eos/pad: vLLM copies sampling defaults (temperature, top_p, ...) from
    # generation_config.json, and we want requests to mean exactly what they say.
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "rollover_model.json").write_text(json.dumps({"kind": "tiny", "arch": arch, "seed": seed}, indent=2) + "\n")
    return out
