"""The tiny vision-language model: Qwen2-VL's architecture built locally, its tokenizer with the
vision tokens, its chat template, and its image processor, which needs no torchvision."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from rollover.engine.images import image_limit
from rollover.modelzoo.tiny_vl import IMAGE_MARKER, IMAGE_PAD, build_tiny_vl_model
from rollover.vision.inputs import expand_placeholders, image_runs, load_image_processor, pixel_inputs, position_ids
from rollover.vision.model import auto_model_class, takes_images


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl") / "model", max_image_tokens=16)


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buffer, "PNG")
    return buffer.getvalue()


def test_the_folder_is_a_qwen2_vl_checkpoint_with_its_processor(tiny_vl: Path) -> None:
    config = json.loads((tiny_vl / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"] and config["model_type"] == "qwen2_vl"
    # 16 = half a 32-wide head; width gets all but the two highest frequencies (default_mrope_section)
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [1, 1, 14]
    assert config["vision_config"]["spatial_merge_size"] == 2 and config["vision_config"]["hidden_size"] == 128
    assert json.loads((tiny_vl / "preprocessor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"
    assert takes_images(tiny_vl) and auto_model_class(tiny_vl).__name__ == "AutoModelForImageTextToText"
    assert image_limit(tiny_vl, None, ()) == (4, ["--limit-mm-per-prompt", '{"image": 4, "video": 0}'])
    assert image_limit(tiny_vl, 1, ["--limit-mm-per-prompt", '{"image": 2}']) == (2, [])


def test_the_template_marks_each_image_and_the_model_reads_it(tiny_vl: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 1+2?"}]},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count(IMAGE_MARKER) == 2 and "What is 1+2?" in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(image_id) == 2  # each marker is special: never split

    processor = load_image_processor(tiny_vl)
    pixels = pixel_inputs(processor, [png(140, 28), png(56, 56)])
    assert pixels.image_grid_thw.tolist() == [[1, 2, 10], [1, 4, 4]] and pixels.tokens == (5, 4)
    expanded = expand_placeholders(ids, image_id, pixels.tokens)
    assert image_runs(expanded, image_id) == [5, 4]

    model = auto_model_class(tiny_vl).from_pretrained(tiny_vl)
    input_ids = torch.tensor([expanded])
    mask = torch.ones_like(input_ids)
    positions = position_ids(model, input_ids, mask, pixels.image_grid_thw, image_id)
    first = expanded.index(image_id)
    # The first image's 5 tokens sit on one row (height 0) at widths 0..4; the text after it
    # resumes past its widest coordinate.
    assert positions[:, 0, first : first + 5].tolist() == [[first] * 5, [first] * 5, list(range(first, first + 5))]
    assert positions[0, 0, first + 5].item() == first + 5
    logits = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        pixel_values=pixels.pixel_values,
        image_grid_thw=pixels.image_grid_thw,
    ).logits
    assert logits.shape == (1, len(expanded), len(tokenizer))
    # The image changes what the model predicts after it.
    other = pixel_inputs(processor, [png(140, 28), png(56, 56)]).pixel_values * 0 + 1
    changed = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        pixel_values=other,
        image_grid_thw=pixels.image_grid_thw,
    ).logits
    assert not torch.allclose(logits[0, -1], changed[0, -1])


def test_vllms_processor_loads_without_torchvision_through_the_plugin(tiny_vl: Path) -> None:
    """What vLLM does in each of its processes: load the plugins, then Qwen2-VL's processor."""
    probe = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torchvision') is None\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm.model_executor.models.qwen2_vl\n"
        "from transformers.models.qwen2_vl import Qwen2VLProcessor\n"
        f"p = Qwen2VLProcessor.from_pretrained({str(tiny_vl)!r})\n"
        "print(type(p.image_processor).__name__)\n"
        "try:\n"
        "    p.video_processor(videos=[])\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == [
        "Qwen2VLImageProcessorPil",
        "this engine takes no videos (no torchvision in this install): send images",
    ]
