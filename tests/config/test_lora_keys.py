"""verl's LoRA keys: their defaults, the engine flags they turn on, and bad values refused naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollover.config import ConfigError, load_config
from rollover.distributed.world import World
from rollover.engine.pool import node_engines
from rollover.engine.settings import EngineSettings
from rollover.modelzoo.chat_template import chatml_template

MODEL = "actor_rollout_ref.model"
ROLLOUT = "actor_rollout_ref.rollout"


def engine(tmp_path: Path, *overrides: str):  # -> VLLMEngine
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "chat_template.jinja").write_text(chatml_template())
    config = load_config(None, ["trainer.device=cpu", *overrides])
    [built] = node_engines(EngineSettings.from_config(config), model, tmp_path, World())
    return built


def test_verl_defaults_leave_lora_off_and_the_engine_as_it_was(tmp_path):
    config = load_config(None, [])
    model = config.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")
    assert model.exclude_modules is None and model.lora_adapter_path is None and not model.lora
    built = engine(tmp_path)
    assert not [a for a in built.command() if a.startswith("--") and "lora" in a]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in built.extra_env


def test_lora_rank_turns_on_runtime_adapters_in_the_engine(tmp_path):
    built = engine(tmp_path, f"{MODEL}.lora_rank=12", f"{ROLLOUT}.max_loras=2")
    argv = built.command()
    assert argv.count("--enable-lora") == 1
    assert argv[argv.index("--max-loras") + 1] == "2"
    assert argv[argv.index("--max-lora-rank") + 1] == "16"  # 12 rounded up to a rank vLLM takes
    assert built.extra_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv = engine(tmp_path, f"{MODEL}.lora_rank=8", f"{ROLLOUT}.max_lora_rank=64").command()
    assert argv[argv.index("--max-lora-rank") + 1] == "64"


def test_target_modules_take_a_list(tmp_path):
    config = load_config(None, [f"{MODEL}.lora_rank=4", f"{MODEL}.target_modules=[q_proj,v_proj]"])
    assert config.actor_rollout_ref.model.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (f"{MODEL}.lora_rank=-1", f"{MODEL}.lora_rank"),
        (f"{MODEL}.lora_alpha=0", f"{MODEL}.lora_alpha"),
        (f"{MODEL}.target_modules=[]", f"{MODEL}.target_modules"),
        (f"{ROLLOUT}.max_loras=0", f"{ROLLOUT}.max_loras"),
        (f"{ROLLOUT}.max_lora_rank=12", f"{ROLLOUT}.max_lora_rank"),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_rules_across_keys_name_both(tmp_path):
    with pytest.raises(ConfigError, match=r"max_lora_rank=8 is below .*lora_rank=16"):
        load_config(None, [f"{MODEL}.lora_rank=16", f"{ROLLOUT}.max_lora_rank=8"])
    with pytest.raises(ConfigError, match=r"lora_adapter_path needs actor_rollout_ref\.model\.lora_rank > 0"):
        load_config(None, [f"{MODEL}.lora_adapter_path={tmp_path}"])
    # LoRA with partial rollout: the engine reloads the adapter in place, kept requests go on with it.
    both = load_config(
        None,
        [
            f"{MODEL}.lora_rank=8",
            "agentlightning.async_rollout.enabled=true",
            "agentlightning.async_rollout.async_train_batch_size=64",
            "agentlightning.async_rollout.partial_rollout=true",
        ],
    )
    assert both.actor_rollout_ref.model.lora and both.agentlightning.async_rollout.partial_rollout
