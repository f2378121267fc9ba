"""The LoRA adapter folder the trainer writes and the engines load: PEFT's own format
(`adapter_config.json`, `adapter_model.safetensors`), or with several policies a PEFT folder
per policy (`<folder>/<policy>/`). Paths only, no torch: it sits below both the trainer, which
writes it, and the engine, which reads it, so neither imports the other."""

from __future__ import annotations

from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def policy_adapters(directory: str | Path) -> dict[str, Path]:
    """A several-policy adapter folder's PEFT folders by policy ({} for a one-policy folder)."""
    root = Path(directory)
    if not root.is_dir() or is_adapter(root):
        return {}
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir() and is_adapter(d)}
