import pytest
import yaml
from pydantic import BaseModel

from rollover.config import ConfigError, RolloverConfig, load_config
from rollover.config_yaml import config_yaml, default_config_text
from rollover.training.settings import TrainerSettings


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
        TrainerSettings.from_config(load_config(None, overrides))
    message = str(excinfo.value)
    assert (
        "async_train_batch_size" in message
        and "train_batch_size=8" in message
        and f"async_train_batch_size={window}" in message
    )


def test_async_window_ok():
    TrainerSettings.from_config(
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


def test_the_trainers_settings_check_the_rule_after_a_nested_assignment():
    config = load_config(None, ["data.train_batch_size=8"])
    config.agentlightning.async_rollout.enabled = True  # pydantic does not re-run the root validator
    with pytest.raises(ValueError, match="async_train_batch_size=None, train_batch_size=8"):
        TrainerSettings.from_config(config)
    config.agentlightning.async_rollout.async_train_batch_size = 16
    TrainerSettings.from_config(config)


# -- Agent Lightning's names --------------------------------------------------------------


@pytest.mark.parametrize("spec", ["examples.calc.agent:CalcAgent", "examples.calc.agent.CalcAgent", "m.A", "m:A.B"])
def test_agent_class_in_either_form(spec):
    assert load_config(None, [f"agentlightning.local.agent_class={spec}"]).agentlightning.local.agent_class == spec


@pytest.mark.parametrize("spec", ["Agent", "pkg.module:", ":Class", "a:b:c", "pkg..Class", "pkg.mod-ule.Class"])
def test_agent_class_that_names_no_class_is_refused(spec):
    with pytest.raises(ConfigError, match=r"agentlightning\.local\.agent_class"):
        load_config(None, [f"agentlightning.local.agent_class={spec}"])


AGL_STYLE = """\
hydra:
  searchpath: [pkg://somewhere]
defaults: [ppo_trainer, _self_]
algorithm:
  enable_rollout_level_advantage: true
data:
  train_batch_size: 2
  filter_overlong_prompts: false
actor_rollout_ref:
  actor:
    calculate_entropy: false
    policy_loss:
      loss_mode: per_rollout_mean
  rollout:
    mode: async
    n: 2
agentlightning:
  agl_base_url: http://127.0.0.1:18080
  agl_key: my-key
  hooks: null
  rollout_timeout_seconds: 300
  local:
    agent_class: my_agents.calc.Agent
    env_map: {QUESTION: input.question}
  reward_fillna_value: -1.0
  max_ppo_update_times: 2
  trace_aggregator:
    level: transition
    trajectory_max_prompt_length: 1024
    trajectory_max_response_length: 4096
  async_rollout:
    enabled: true
    async_train_batch_size: 4
"""


def test_an_agent_lightning_yaml_loads_with_its_keys_mapped(tmp_path, caplog):
    path = tmp_path / "agl.yaml"
    path.write_text(AGL_STYLE)
    with caplog.at_level("WARNING", logger="rollover.config"):
        config = load_config(path)
    assert (config.gateway.host, config.gateway.port) == ("127.0.0.1", 18080)
    assert config.gateway.admin_key == "my-key"
    assert config.algorithm.reward_fillna_value == -1.0
    assert config.agentlightning.local.agent_class == "my_agents.calc.Agent"
    assert config.agentlightning.trace_aggregator.level == "transition"
    # max_ppo_update_times and per_rollout_mean are implemented: only Hydra's directives warn
    assert config.agentlightning.max_ppo_update_times == 2
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'hydra', 'defaults'" in lines[0], lines
    # what `rollover config show` prints loads back as the same config
    shown = tmp_path / "shown.yaml"
    shown.write_text(config_yaml(config))
    assert load_config(shown) == config


def test_agent_lightning_defaults_change_nothing():
    config = load_config(
        None,
        ["agentlightning.agl_key=", "agentlightning.reward_fillna_value=0.0", "agentlightning.hooks=null"],
    )
    assert config.gateway.admin_key is None  # "" is Agent Lightning's "no key": one is generated
    assert config == load_config(None, ["agentlightning.agl_key=", "agentlightning.reward_fillna_value=0.0"])
    assert config.gateway.port == 0 and config.algorithm.reward_fillna_value == 0.0


@pytest.mark.parametrize(
    "agl,rollover,agreeing",
    [
        (
            "agentlightning.reward_fillna_value=-1",
            "algorithm.reward_fillna_value=0.5",
            "algorithm.reward_fillna_value=-1",
        ),
        ("agentlightning.agl_base_url=http://127.0.0.1:8080", "gateway.port=9090", "gateway.port=8080"),
        ("agentlightning.agl_key=a", "gateway.admin_key=b", "gateway.admin_key=a"),
    ],
)
def test_both_names_must_agree(agl, rollover, agreeing):
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, [agl, rollover])
    assert f"'{agl.split('=')[0]}'" in str(excinfo.value) and f"'{rollover.split('=')[0]}'" in str(excinfo.value)
    load_config(None, [agl, agreeing])


@pytest.mark.parametrize("url", ["https://example.org:8080", "localhost:8080", "http://:8080", "http://h:99999"])
def test_agl_base_url_must_be_a_plain_http_url(url):
    with pytest.raises(ConfigError, match=r"agentlightning\.agl_base_url"):
        load_config(None, [f"agentlightning.agl_base_url={url}"])


def test_rollout_level_advantage_cannot_be_switched_off():
    with pytest.raises(ConfigError, match=r"algorithm\.enable_rollout_level_advantage"):
        load_config(None, ["algorithm.enable_rollout_level_advantage=false"])


def test_agent_env_names_are_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('agentlightning:\n  local:\n    env:\n      "A=B": "1"\n')
    with pytest.raises(ConfigError, match=r"agentlightning\.local\.env.*not an environment variable name"):
        load_config(path)
    assert load_config(None, ["agentlightning.local.env.MODE=fast"]).agentlightning.local.env == {"MODE": "fast"}
