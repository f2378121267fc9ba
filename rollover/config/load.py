"""Loading: defaults ← YAML file ← dotlist overrides, merged with OmegaConf and validated with
pydantic, so every mistake is a `ConfigError` naming the dotted key."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from rollover.config.base import ConfigError
from rollover.config.no_effect import no_effect_notes
from rollover.config.root import AGENT_LIGHTNING_NAMES, RolloverConfig, agent_lightning_mapped_values

log = logging.getLogger("rollover.config")

# Hydra's composition directives in Agent Lightning's YAML (its `defaults: [ppo_trainer, _self_]`).
HYDRA_DIRECTIVES = ("hydra", "defaults")


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (the keys a user gave, by their dotted names)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_both_names(given: dict[str, Any], config: RolloverConfig) -> None:
    """A file that sets a key under both names must agree with itself."""
    mapped = agent_lightning_mapped_values(config.agentlightning)
    for agl_key, rollover_keys in AGENT_LIGHTNING_NAMES.items():
        if agl_key not in given:
            continue
        for key in rollover_keys:
            if key in given and key in mapped and given[key] != mapped[key]:
                raise ConfigError(
                    f"config keys '{agl_key}' ({given[agl_key]!r}) and '{key}' ({given[key]!r}) disagree: "
                    "set one of them"
                )


def _user_meaning(given: dict[str, Any], raw: dict[str, Any]) -> None:
    """verl's run length: a config that gives total_epochs and not total_training_steps
    means epochs (Rollover's default of 10 steps would otherwise win)."""
    if "trainer.total_epochs" in given and "trainer.total_training_steps" not in given:
        raw["trainer"]["total_training_steps"] = None


def validate_config(raw: dict[str, Any]) -> RolloverConfig:
    try:
        return RolloverConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError.from_validation(exc) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    directives = [key for key in HYDRA_DIRECTIVES if key in loaded]
    if directives:
        log.warning(
            "config keys %s (Hydra's composition) have no effect in Rollover: its own defaults are the base",
            ", ".join(f"'{key}'" for key in directives),
        )
    return {key: value for key, value in loaded.items() if key not in directives}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RolloverConfig:
    """Defaults ← YAML file ← dotlist overrides, validated; raises `ConfigError`."""
    layers = [OmegaConf.create(RolloverConfig().model_dump(mode="json"))]
    if path is not None:
        layers.append(OmegaConf.create(_read_yaml(Path(path))))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as exc:
            key, _, value = item.partition("=")
            problem = str(exc).splitlines()[0]
            raise ConfigError(
                f"config key {key!r}: the override value {value!r} is not YAML ({problem}); quote it,"
                " or write a mapping with spaces after the colons: key={a: 1}"
            ) from None
    try:
        raw = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True)
        user = OmegaConf.to_container(OmegaConf.merge({}, *layers[1:]), resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge config: {exc}") from None
    assert isinstance(raw, dict) and isinstance(user, dict)
    given = dotted({str(key): value for key, value in user.items()})
    merged: dict[str, Any] = {str(key): value for key, value in raw.items()}
    _user_meaning(given, merged)
    config = validate_config(merged)
    _check_both_names(given, config)
    for note in no_effect_notes(config):
        log.warning("%s", note)
    if config.loss.note is not None:
        log.warning("%s", config.loss.note)
    return config


# Keys whose values open the gateway: never written to a run folder, W&B or a log.
SECRET_KEYS = (("gateway", "admin_key"), ("agentlightning", "agl_key"))
REDACTED = "<redacted>"


def redacted(config: RolloverConfig) -> dict[str, Any]:
    """The config as plain data, with the gateway's keys replaced by a marker."""
    data = config.model_dump(mode="json")
    for section, key in SECRET_KEYS:
        if data.get(section, {}).get(key):
            data[section][key] = REDACTED
    return data


def dump_config(config: RolloverConfig) -> str:
    """The YAML a run folder keeps (keys redacted)."""
    return yaml.safe_dump(redacted(config), sort_keys=False)
