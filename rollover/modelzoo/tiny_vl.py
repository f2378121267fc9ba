"""A tiny random-init vision-language model: Qwen2-VL's architecture (a vision tower whose
patches are merged 2x2 into the language model's tokens, 3-D mRoPE positions), its processor
and a chat template, with the tokenizer trained locally as the tiny text model's is.

Nothing is downloaded. The folder is a normal Hugging Face checkpoint: transformers loads it
(`Qwen2VLForConditionalGeneration`, its image processor) and vLLM serves it (images as OpenAI
`image_url` parts). Each image token covers 28x28 pixels (14-pixel patches, merged 2x2); the
image processor keeps images between `min_pixels` and `max_pixels` (resized to multiples of 28).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollover.modelzoo.chat_template import chatml_template
from rollover.modelzoo.tiny import IM_END, IM_START, PAD_TOKEN, build_tiny_tokenizer

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"  # named by the config; the model takes no videos here
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
IMAGE_MARKER = VISION_START + IMAGE_PAD + VISION_END
CHAT_TEMPLATE = chatml_template(image_marker=IMAGE_MARKER)
PATCH_SIZE = 14
MERGE_SIZE = 2
PIXELS_PER_TOKEN = (PATCH_SIZE * MERGE_SIZE) ** 2


def build_tiny_vl_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    vision_width: int = 64,
    vision_depth: int = 2,
    max_image_tokens: int = 64,
    corpus: Any = None,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    mrope_section: tuple[int, int, int] | None = None,
) -> Path:
    """Write the model, its tokenizer (the tiny model's plus the vision tokens), image processor
    and chat template to `out_dir`. An image becomes at most `max_image_tokens` tokens."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if hidden_size % num_heads or (hidden_size // num_heads) % 8:
        raise ValueError(f"hidden_size / num_heads must be a multiple of 8 (mRoPE), got {hidden_size}/{num_heads}")
    if max_image_tokens < 1:
        raise ValueError(f"max_image_tokens must be positive, got {max_image_tokens}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(
        out, vocab_size=vocab_size, corpus=corpus, seed=seed, model_max_length=max_position_embeddings
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, *VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    ids = tokenizer.convert_tokens_to_ids
    eos_id, pad_id = ids(IM_END), ids(PAD_TOKEN)
    half = hidden_size // num_heads // 2
    sections = list(mrope_section) if mrope_section is not None else default_mrope_section(half)
    if len(sections) != 3 or sum(sections) != half or min(sections) < 1:
        raise ValueError(f"mrope_section must be 3 positive sizes summing to {half}, got {sections}")
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": hidden_size * 3,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_heads // 2 if num_heads % 2 == 0 else num_heads,
            "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": sections},
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "bos_token_id": None,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": vision_depth,
            "embed_dim": vision_width,
            "hidden_size": hidden_size,  # the merger's output: the language model's width
            "num_heads": max(1, vision_width // 16),
            "mlp_ratio": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).float()
    # Only eos/pad, as the tiny model: requests mean exactly what they say (see tiny.py).
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(str(out), safe_serialization=True)
    # The image processor that needs no torchvision (transformers' default one does).
    processor = Qwen2VLImageProcessorPil(
        min_pixels=PIXELS_PER_TOKEN, max_pixels=PIXELS_PER_TOKEN * max_image_tokens, merge_size=MERGE_SIZE
    )
    processor.save_pretrained(str(out))
    _name_the_processor(out)
    (out / "rollover_model.json").write_text(
        json.dumps(
            {"kind": "tiny-vl", "arch": "qwen2_vl", "seed": seed, "max_image_tokens": max_image_tokens}, indent=2
        )
        + "\n"
    )
    return out


def _name_the_processor(out: Path) -> None:
    """The processor class beside the image processor's settings, as Qwen2-VL checkpoints have
    it (vLLM and `AutoProcessor` read `processor_class`)."""
    path = out / "preprocessor_config.json"
    settings = json.loads(path.read_text())
    settings["processor_class"] = "Qwen2VLProcessor"
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def default_mrope_section(half: int) -> list[int]:
    """The split of a head's rotary half-dimension into (time, height, width) sections: one
    frequency each for time and height, the rest for width.

    Qwen2-VL's mRoPE hands the sections the frequencies in order, highest first, so width gets
    the lowest. Its own split (a quarter for time, the rest halved) leaves a 32-wide head's width
    rotating 0.003 radian or less from one image token to the next: the language model cannot
    tell the tokens of a row apart, and reads at best what no position is needed for (measured
    on the vision calc example: the operator learned, the digits at chance). This split gives
    width 0.32 radian a token at its highest frequency, height 0.56, time 1; text positions
    (equal on the three axes) see every frequency either way."""
    return [1, 1, half - 2]
