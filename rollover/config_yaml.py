"""The config as commented YAML: `rollover/configs/default.yaml` is `config_yaml()`.

Each key's description (from the models in `rollover.config`) becomes its comment, aligned, and
top-level sections stand apart, so the generated file reads like a hand-written one.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel

from rollover.config import RolloverConfig

DEFAULTS_HEADER = """\
# Rollover's defaults: every key a user can set, with its default and what it means.
# GENERATED from the models in rollover/config/ by `rollover config defaults`: edit those.
# A run's YAML and command-line `key=value` overrides are merged on top; unknown keys are an error.
"""
_COMMENT_COLUMN = 34


def _scalar(value: Any) -> str:
    """One YAML value on one line (flow style for lists and mappings)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip()


def _commented(line: str, description: str | None) -> str:
    if not description:
        return line
    return f"{line.ljust(max(_COMMENT_COLUMN, len(line) + 2))}# {description}"


def _section_lines(model: BaseModel, values: dict[str, Any], indent: int) -> list[str]:
    lines: list[str] = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if indent == 0 and lines:
            lines.append("")  # top-level sections stand apart
        prefix = f"{' ' * indent}{name}:"
        if isinstance(value, BaseModel):
            lines.append(_commented(prefix, field.description))
            lines += _section_lines(value, values[name], indent + 2)
        else:
            lines.append(_commented(f"{prefix} {_scalar(values[name])}", field.description))
    return lines


def config_yaml(config: RolloverConfig | None = None, header: str = DEFAULTS_HEADER) -> str:
    """`config` (default: the defaults) as YAML with each key's description as its comment;
    `rollover/configs/default.yaml` is this text for the defaults."""
    config = config or RolloverConfig()
    body = _section_lines(config, config.model_dump(mode="json"), 0)
    return header + "\n".join(body) + "\n"


def default_config_text() -> str:
    """The shipped `rollover/configs/default.yaml` (tests check it equals `config_yaml()`)."""
    return resources.files("rollover.configs").joinpath("default.yaml").read_text()
