"""Typed configuration: the embedded defaults, a run's YAML and `key=value` overrides.

Keys follow the seed document (and verl where verl has a name). Loading merges the three
layers with OmegaConf, then validates the result with pydantic so that every mistake is
reported as a `ConfigError` naming the dotted key.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """A bad configuration value; the message names the dotted key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    train_files: str | None = None
    val_files: str | None = None
    train_batch_size: int = Field(32, gt=0)
    val_batch_size: int = Field(32, gt=0)
    max_prompt_length: int = Field(512, gt=0)
    max_response_length: int = Field(256, gt=0)
    seed: int = 0


class ModelConfig(_Section):
    path: str | None = None
    served_model_name: str = "policy"


class ValKwargs(_Section):
    temperature: float = Field(0.0, ge=0.0)


class RolloutConfig(_Section):
    n: int = Field(4, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    val_kwargs: ValKwargs = ValKwargs()
    max_model_len: int = Field(2048, gt=0)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    kv_cache_space_gb: int = Field(1, gt=0)
    enforce_eager: bool = True
    engine_args: list[str] = []
    start_timeout_seconds: float = Field(300, gt=0)
    max_engine_restarts: int = Field(3, ge=0)


class OptimConfig(_Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class ActorConfig(_Section):
    optim: OptimConfig = OptimConfig()
    ppo_epochs: int = Field(1, gt=0)
    ppo_mini_batch_size: int | None = Field(None, gt=0)
    ppo_micro_batch_size: int = Field(8, gt=0)
    clip_ratio: float = Field(0.2, gt=0, lt=1)
    clip_ratio_c: float = Field(3.0, gt=1)
    grad_clip: float = Field(1.0, gt=0)


class ActorRolloutRefConfig(_Section):
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    store: str | None = None
    admin_key: str | None = None
    retry_after_seconds: float = Field(5, ge=0)
    upstream_timeout_seconds: float = Field(600, gt=0)
    upstream_retries: int = Field(3, ge=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    drain_timeout_seconds: float = Field(300, gt=0)


class LocalRunnerConfig(_Section):
    agent_class: str | None = None
    env_map: dict[str, str] = {}
    max_concurrency: int = Field(64, gt=0)
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    preload_modules: list[str] = []

    @field_validator("agent_class")
    @classmethod
    def _module_colon_class(cls, value: str | None) -> str | None:
        if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
            raise ValueError(f"must look like 'pkg.module:Class', got {value!r}")
        return value


class K8sRunnerConfig(_Section):
    job_template_path: str | None = None
    namespace: str = "default"
    jobs_per_minute: float = Field(120, gt=0)
    ttl_seconds_after_finished: int = Field(600, ge=0)
    kubeconfig: str | None = None
    gateway_url: str | None = None


class AsyncRolloutConfig(_Section):
    enabled: bool = False
    async_train_batch_size: int | None = Field(None, gt=0)
    max_carry_over_age_steps: int | None = Field(None, ge=0)


class AgentLightningConfig(_Section):
    rollout_timeout_seconds: float = Field(1800, gt=0)
    max_attempts: int = Field(1, gt=0)
    runner: Literal["local", "k8s"] = "local"
    local: LocalRunnerConfig = LocalRunnerConfig()
    k8s: K8sRunnerConfig = K8sRunnerConfig()
    async_rollout: AsyncRolloutConfig = AsyncRolloutConfig()


class RolloutCorrectionConfig(_Section):
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: float = Field(2.0, gt=0)


class AlgorithmConfig(_Section):
    adv_estimator: Literal["grpo", "rloo"] = "grpo"
    reward_fillna_value: float = 0.0
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()


class TrainerConfig(_Section):
    setup_hook: str | None = None
    project_name: str = "rollover"
    experiment_name: str = "run"
    default_local_dir: str = "runs"
    total_training_steps: int = Field(10, gt=0)
    total_epochs: int | None = Field(None, gt=0)
    logger: list[Literal["console", "jsonl", "wandb"]] = ["console", "jsonl"]
    save_freq: int = Field(0, ge=0)
    test_freq: int = Field(0, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0

    @property
    def run_dir(self) -> Path:
        return Path(self.default_local_dir) / self.experiment_name


class RolloverConfig(_Section):
    data: DataConfig = DataConfig()
    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    gateway: GatewayConfig = GatewayConfig()
    agentlightning: AgentLightningConfig = AgentLightningConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    resume: bool = False


def default_config_text() -> str:
    return resources.files("rollover.configs").joinpath("default.yaml").read_text()


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown config key '{key}'"
    got = error.get("input")
    return f"config key '{key}': {error['msg']} (got {got!r})"


def validate_config(raw: dict[str, Any]) -> RolloverConfig:
    try:
        return RolloverConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(e) for e in exc.errors())) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RolloverConfig:
    """Defaults ← YAML file ← dotlist overrides, validated; raises `ConfigError`."""
    layers = [OmegaConf.create(default_config_text())]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        layers.append(OmegaConf.create(loaded))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        raw = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge config: {exc}") from None
    assert isinstance(raw, dict)
    return validate_config(raw)


def check_async_rollout(config: RolloverConfig) -> None:
    """The seed's rule, enforced when the Trainer is constructed."""
    async_cfg = config.agentlightning.async_rollout
    if not async_cfg.enabled:
        return
    train = config.data.train_batch_size
    window = async_cfg.async_train_batch_size
    if window is None or window <= train:
        raise ValueError(
            "agentlightning.async_rollout.async_train_batch_size must be set and greater than "
            f"data.train_batch_size when agentlightning.async_rollout.enabled is true "
            f"(got async_train_batch_size={window}, train_batch_size={train}); "
            f"a good start is {2 * train}"
        )


def dump_config(config: RolloverConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
