"""The vision-language warm-up: chats with images train the tiny Qwen2-VL on its assistant
turns (the images through its processor), and the folder it writes loads and serves as before."""

from __future__ import annotations

import json
from pathlib import Path

from examples.vision_calc.task import demonstration, make_tasks, render
from rollover.modelzoo.tiny_vl import build_tiny_vl_model
from rollover.modelzoo.vl_warmup import chat_images
from rollover.modelzoo.warmup import sft_warmup


def test_a_few_steps_lower_the_loss_and_write_a_loadable_model(tmp_path: Path) -> None:
    base = build_tiny_vl_model(tmp_path / "base", max_image_tokens=16)
    chats = [demonstration(task) for task in make_tasks(8, seed=0)]
    assert chat_images(chats[0]) == [render(make_tasks(1, seed=0)[0]["expression"])]
    metrics = sft_warmup(base, chats, tmp_path / "warm", steps=12, batch_size=4, lr=3e-3, num_threads=1)
    assert metrics["final_loss"] < metrics["initial_loss"]
    names = {p.name for p in (tmp_path / "warm").iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "chat_template.jinja"} <= names
    config = json.loads((tmp_path / "warm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
