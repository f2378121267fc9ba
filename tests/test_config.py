import pytest
import yaml
from pydantic import BaseModel

from rollover.config import (
    ConfigError,
    RolloverConfig,
    check_async_rollout,
    config_yaml,
    default_config_text,
    load_config,
)


def test_defaults_match_the_seed():
    config = load_config()
    assert config.agentlightning.async_rollout.enabled is False
    assert config.agentlightning.async_rollout.async_train_batch_size is None
    assert config.agentlightning.rollout_timeout_seconds == 1800
    assert config.algorithm.rollout_correction.rollout_is is None
    assert config.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert config.data.train_batch_size == 32 and config.actor_rollout_ref.rollout.n == 4


def test_yaml_then_dotlist(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  train_batch_size: 8\nagentlightning:\n  async_rollout:\n    enabled: true\n    async_train_batch_size: 16\n"
    )
    config = load_config(path, ["data.train_batch_size=4", "algorithm.rollout_correction.rollout_is=token"])
    assert config.data.train_batch_size == 4
    assert config.agentlightning.async_rollout.async_train_batch_size == 16
    assert config.algorithm.rollout_correction.rollout_is == "token"


@pytest.mark.parametrize(
    "override,key",
    [
        ("data.train_batch_sise=3", "data.train_batch_sise"),
        ("data.train_batch_size=abc", "data.train_batch_size"),
        ("data.train_batch_size=-1", "data.train_batch_size"),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
        ("algorithm.rollout_correction.rollout_is=tokens", "algorithm.rollout_correction.rollout_is"),
        ("agentlightning.local.agent_class=no_colon", "agentlightning.local.agent_class"),
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["justakey"])


@pytest.mark.parametrize("window", [None, 8, 4])
def test_async_window_must_exceed_the_batch(window):
    overrides = ["agentlightning.async_rollout.enabled=true", "data.train_batch_size=8"]
    if window is not None:
        overrides.append(f"agentlightning.async_rollout.async_train_batch_size={window}")
    with pytest.raises(ValueError) as excinfo:
        check_async_rollout(load_config(None, overrides))
    message = str(excinfo.value)
    assert (
        "async_train_batch_size" in message
        and "train_batch_size=8" in message
        and f"async_train_batch_size={window}" in message
    )


def test_async_window_ok():
    check_async_rollout(
        load_config(
            None,
            [
                "agentlightning.async_rollout.enabled=true",
                "data.train_batch_size=8",
                "agentlightning.async_rollout.async_train_batch_size=16",
            ],
        )
    )


def test_shipped_default_yaml_is_generated_from_the_models():
    assert default_config_text() == config_yaml(), (
        "rollover/configs/default.yaml is stale: regenerate it with "
        "`rollover config defaults > rollover/configs/default.yaml`"
    )


def _sections(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _sections(annotation, f"{prefix}{name}.")


def test_every_key_has_a_one_line_description():
    keys = dict(_sections(RolloverConfig))
    assert "agentlightning.async_rollout.async_train_batch_size" in keys and "gateway" in keys
    missing = [key for key, field in keys.items() if not field.description or "\n" in field.description]
    assert not missing


def test_generated_yaml_loads_back_as_the_same_config(tmp_path):
    assert yaml.safe_load(config_yaml()) == RolloverConfig().model_dump(mode="json")
    config = load_config(None, ["data.train_batch_size=3", "agentlightning.local.env_map.TASK=input.q"])
    path = tmp_path / "shown.yaml"
    path.write_text(config_yaml(config))
    assert load_config(path) == config


def test_loading_refuses_a_bad_async_window_in_one_line():
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["agentlightning.async_rollout.enabled=true", "data.train_batch_size=8"])
    message = str(excinfo.value)
    assert message.startswith("agentlightning.async_rollout.async_train_batch_size must be set")
    assert "async_train_batch_size=None, train_batch_size=8" in message and "\n" not in message


def test_the_rule_is_checked_again_after_a_nested_assignment():
    config = load_config(None, ["data.train_batch_size=8"])
    config.agentlightning.async_rollout.enabled = True  # pydantic does not re-run the root validator
    with pytest.raises(ValueError, match="async_train_batch_size=None, train_batch_size=8"):
        check_async_rollout(config)
    config.agentlightning.async_rollout.async_train_batch_size = 16
    check_async_rollout(config)
