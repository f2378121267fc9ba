"""Which of vLLM's tool-call parsers a model needs, read off its chat template: agent
frameworks send `tools` and read `tool_calls`, which vLLM parses out of the text."""

from __future__ import annotations

import json
from pathlib import Path


def chat_template_of(model_dir: str | Path) -> str:
    """The chat template a model folder ships (either place transformers keeps it), or ""."""
    folder = Path(model_dir)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return ""
    return template if isinstance(template, str) else ""


def resolve_tool_call_parser(setting: str | None, model_dir: str | Path) -> str | None:
    """`auto`: vLLM's `hermes` parser when the model's template writes `<tool_call>` blocks
    (the bundled models' and Qwen2.5's do), else none; any other name is vLLM's parser name."""
    if setting != "auto":
        return setting
    return "hermes" if "<tool_call>" in chat_template_of(model_dir) else None
