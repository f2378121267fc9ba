import pytest

from rollover.config import ConfigError, check_async_rollout, load_config


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
