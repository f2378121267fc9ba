"""Typed configuration: the models below, a run's YAML and `key=value` overrides.

This module is over 600 lines on purpose: it is the schema, one model per section and one
description per key; split, a reader would hunt a key across files.

The pydantic models are the one place a key, its default and its one-line description live;
`rollover/configs/default.yaml` is generated from them (`rollover.config_yaml`, `rollover config defaults`; a test
fails when the shipped file is stale). Keys follow the seed document (and verl where verl has
a name). Loading merges defaults ← YAML ← dotlist overrides with OmegaConf, then validates the
result with pydantic so that every mistake is reported as a `ConfigError` naming the dotted key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

log = logging.getLogger("rollover.config")


class ConfigError(ValueError):
    """A bad configuration value; the message names the dotted key."""

    @classmethod
    def from_validation(cls, exc: ValidationError, section: str = "") -> ConfigError:
        """One line naming each bad key; `section` prefixes the keys of a section's model."""
        return cls("; ".join(_describe(error, section) for error in exc.errors()))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Temperature = Annotated[float, Field(ge=0.0)]


class DataConfig(_Section):
    train_files: str | None = Field(default=None, description="JSONL, one task input (JSON object) per line")
    val_files: str | None = Field(
        default=None, description="JSONL of held-out tasks, evaluated before and after training"
    )
    train_batch_size: int = Field(default=32, gt=0, description="completed prompt groups consumed by one update")
    val_batch_size: int = Field(default=32, gt=0, description="prompts in a held-out evaluation")
    max_prompt_length: int = Field(
        default=512, gt=0, description="token budget of a prompt; a sample longer than both budgets is cut"
    )
    max_response_length: int = Field(
        default=256, gt=0, description="token budget of a response (see max_prompt_length)"
    )
    seed: int = Field(default=0, description="seed of the prompt order")
    filter_overlong_prompts: bool = Field(
        default=False, description="verl's key, accepted: true has no effect (over-long samples are cut, not filtered)"
    )


class ModelConfig(_Section):
    path: str | None = Field(default=None, description="HF model folder (examples build one when null)")
    served_model_name: str = Field(default="policy", description="the model name vLLM serves and agents ask for")
    enable_gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in the backward pass: less memory, more compute"
    )


class ValKwargs(_Section):
    temperature: Temperature = Field(default=0.0, description="val-mode temperature")


class RolloutConfig(_Section):
    n: int = Field(default=4, gt=0, description="rollouts per prompt group (GRPO/RLOO siblings)")
    temperature: Temperature = Field(default=1.0, description="train-mode sampling temperature, forced by the gateway")
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="sampling of held-out evaluations")
    max_model_len: int = Field(default=2048, gt=0, description="vLLM context length (prompt + response tokens)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        default="float32", description="vLLM weights dtype: float32 | bfloat16 | float16 | auto"
    )
    kv_cache_space_gb: int = Field(default=1, gt=0, description="vLLM CPU KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="GPU: the share of each device's memory vLLM may take (the trainer has the rest)",
    )
    tensor_model_parallel_size: int = Field(
        default=1, ge=1, description="devices per engine; engines per node = trainer.n_gpus_per_node / this"
    )
    engine_host: str = Field(
        default="127.0.0.1",
        description="address engines listen on and register under; a run over several nodes sets each node's own",
    )
    enforce_eager: bool = Field(default=True, description="skip graph capture/compilation: faster engine start")
    engine_args: list[str] = Field(default=[], description="extra vLLM server arguments")
    engine_kwargs: dict[str, dict[str, Any]] = Field(
        default={},
        description="verl's engine_kwargs: vllm.NAME: VALUE is the server flag --NAME VALUE (true: bare flag)",
    )
    tool_call_parser: str | None = Field(
        default="auto",
        description="vLLM tool-call parser for agents' tools; auto = hermes when the chat template writes <tool_call> (bundled models), null = off",
    )
    start_timeout_seconds: float = Field(default=300, gt=0, description="vLLM must serve within this after a (re)start")
    max_engine_restarts: int = Field(
        default=3,
        ge=0,
        description="a crashed engine is restarted with its last weights this often, then the run stops",
    )
    mode: Literal["async", "sync"] = Field(
        default="async", description="verl's key, accepted: the engine is always vLLM's server (verl's async mode)"
    )

    def vllm_flags(self) -> list[str]:
        """`engine_args` plus verl's `engine_kwargs.vllm` as flags (false or null: left out)."""
        flags = list(self.engine_args)
        for name, value in self.engine_kwargs.get("vllm", {}).items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is not False and value is not None:
                flags += [flag, value if isinstance(value, str) else json.dumps(value)]
        return flags


class OptimConfig(_Section):
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")


class PolicyLossConfig(_Section):
    loss_mode: str | None = Field(
        default=None,
        description="Agent Lightning's per_rollout_mean, accepted with no effect: the loss is the token-mean over the mini-batch",
    )


class FSDPConfig(_Section):
    param_offload: bool = Field(
        default=False,
        description="GPU: parameters, gradients and the optimizer step on the host (FSDP2 CPUOffloadPolicy)",
    )
    optimizer_offload: bool = Field(
        default=False, description="verl's key: the same offload as param_offload (FSDP2 offloads them together)"
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="auto = bf16 compute with fp32 gradient reduction on GPU, fp32 on CPU"
    )


class ActorConfig(_Section):
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the policy's optimizer")
    ppo_epochs: int = Field(default=1, gt=0, description="passes over each batch")
    ppo_mini_batch_size: int | None = Field(
        default=None,
        gt=0,
        description="prompts per optimizer step, as in verl (each with rollout.n samples); null = the whole batch",
    )
    ppo_micro_batch_size: int = Field(default=8, gt=0, description="samples per forward pass (gradient accumulation)")
    clip_ratio: float = Field(default=0.2, gt=0, lt=1, description="PPO clip range of the importance ratio")
    clip_ratio_c: float = Field(default=3.0, gt=1, description="dual-clip constant")
    grad_clip: float = Field(default=1.0, gt=0, description="gradient norm clip")
    calculate_entropy: bool = Field(
        default=False, description="verl's key, accepted: true has no effect (no entropy metric is computed)"
    )
    policy_loss: PolicyLossConfig = Field(
        default_factory=PolicyLossConfig, description="verl's policy-loss section (Agent Lightning sets it)"
    )
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP2 over the trainer ranks")


class ActorRolloutRefConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling and the vLLM engine")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="the policy update")


class GatewayConfig(_Section):
    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    advertise_url: str | None = Field(
        default=None,
        description="URL other nodes use to reach the gateway (host 0.0.0.0 runs); null = http://host:port",
    )
    port: int = Field(default=0, ge=0, le=65535, description="0 = pick a free port (its URL is printed)")
    store: str | None = Field(
        default=None, description="SQLite file or :memory:; null = store.db in the run folder (or working directory)"
    )
    admin_key: str | None = Field(default=None, description="null = generated (and printed by `rollover gateway`)")
    retry_after_seconds: float = Field(default=5, ge=0, description="Retry-After sent to agents while paused")
    hold_while_paused: bool = Field(
        default=False,
        description="hold proxy calls that arrive during a pause and forward them at resume (not in flight for the drain); false = the seed's immediate 429",
    )
    max_hold_seconds: float = Field(
        default=600, gt=0, description="with hold_while_paused: a call held this long gets the seed's 429"
    )
    upstream_timeout_seconds: float = Field(default=600, gt=0, description="one engine call, at most")
    upstream_retries: int = Field(default=3, ge=0, description="retries of an engine call on 5xx or timeout")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_json_depth: int = Field(
        default=64, ge=1, le=200, description="request bodies nested deeper than this get 400 (the store keeps 254)"
    )
    max_connections: int = Field(
        default=512, gt=0, description="open client connections at most; more are closed as they are accepted"
    )
    header_timeout_seconds: float = Field(
        default=10, gt=0, description="a connection that has not sent a request's headers in this time is closed"
    )
    keep_alive_seconds: int = Field(default=30, ge=1, description="an idle keep-alive connection is closed after this")
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        default="NORMAL",
        description="NORMAL: acknowledged writes survive a process kill; FULL: a power loss too (an fsync per commit)",
    )
    drain_timeout_seconds: float = Field(
        default=300, gt=0, description="a drain slower than this is an error naming the stuck rollouts"
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="rollover train restarts a dead gateway (same port and store) this often, then the run stops",
    )

    def store_path(self, folder: str | Path) -> str:
        """`store`, or the default file in `folder` (the run folder)."""
        return self.store or str(Path(folder) / "store.db")


class LocalRunnerConfig(_Section):
    agent_class: str | None = Field(
        default=None, description='"pkg.module:Class" (or Agent Lightning\'s "pkg.module.Class") with a run() method'
    )
    env_map: dict[str, str] = Field(default={}, description="ENV_NAME: input.path")
    env: dict[str, str] = Field(
        default={}, description="ENV_NAME: value set for every agent process, on top of the trainer's environment"
    )
    max_concurrency: int = Field(default=64, gt=0, description="agent processes running at once")
    start_method: Literal["forkserver", "spawn"] = Field(
        default="forkserver",
        description="forkserver: fork agents from a process that imported the SDK once; spawn: a fresh interpreter each",
    )
    preload_modules: list[str] = Field(
        default=[],
        description="modules the fork server imports once for every agent (e.g. your agent's, if importing it starts no threads)",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"{name!r} is not an environment variable name")
        return value

    @field_validator("agent_class")
    @classmethod
    def _module_and_class(cls, value: str | None) -> str | None:
        if value is not None and not is_class_spec(value):
            raise ValueError(f"must look like 'pkg.module:Class' or 'pkg.module.Class', got {value!r}")
        return value


def is_class_spec(spec: str) -> bool:
    """`pkg.module:Class` (Rollover) or `pkg.module.Class` (Agent Lightning): dotted names only."""
    module, sep, attribute = spec.partition(":")
    if not sep:
        module, _, attribute = spec.rpartition(".")
    names = [*module.split("."), *attribute.split(".")]
    return bool(module and attribute) and ":" not in attribute and all(n.isidentifier() for n in names)


class K8sRunnerConfig(_Section):
    job_template_path: str | None = Field(default=None, description="Kubernetes Job template (Jinja)")
    namespace: str = Field(default="default", description="namespace of the Jobs")
    jobs_per_minute: float = Field(default=120, gt=0, description="Job creation rate limit")
    ttl_seconds_after_finished: int = Field(
        default=600, ge=0, description="Kubernetes deletes finished Jobs after this"
    )
    kubeconfig: str | None = Field(
        default=None, description="kubeconfig file; null = the pod's service account, else the default kubeconfig"
    )
    gateway_url: str | None = Field(
        default=None, description="how pods reach the gateway; null = the gateway's own URL"
    )
    max_concurrency: int | None = Field(
        default=None, gt=0, description="Jobs running at once; null = local.max_concurrency (a deprecated fallback)"
    )
    env_map: dict[str, str] | None = Field(
        default=None, description="ENV_NAME: input.path for every Job; null = local.env_map (a deprecated fallback)"
    )


class AsyncRolloutConfig(_Section):
    enabled: bool = Field(default=False, description="default: synchronous")
    async_train_batch_size: int | None = Field(
        default=None, gt=0, description="active prompt groups; required and > train_batch_size when enabled"
    )
    max_carry_over_age_steps: int | None = Field(
        default=None, ge=0, description="abort and re-queue groups older than this many updates"
    )


def _gateway_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"must be an http://host:port URL (Rollover's gateway serves plain HTTP), got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"has a bad port: {url!r}") from None
    return parts.hostname, port if port is not None else 80


class TraceAggregatorConfig(_Section):
    level: Literal["trajectory", "transition"] = Field(
        default="trajectory",
        description="trajectory: a call whose prompt extends the previous call joins its sample (tool tokens masked); transition: every call is its own sample",
    )
    trajectory_max_prompt_length: int | None = Field(
        default=None, gt=0, description="trajectory level: with the next key, a sample's token budget (null = data's)"
    )
    trajectory_max_response_length: int | None = Field(
        default=None, gt=0, description="trajectory level: a sample's budget after its first prompt (null = data's)"
    )
    trajectory_max_total_length: int | None = Field(
        default=None, gt=0, description="trajectory level: a sample's whole token budget, at most (null = no extra cap)"
    )


class AgentLightningConfig(_Section):
    rollout_timeout_seconds: float = Field(
        default=1800, gt=0, description="a rollout running longer fails (paused time does not count)"
    )
    max_attempts: int = Field(default=1, gt=0, description="attempts per rollout before it counts as failed")
    runner: Literal["local", "k8s"] = Field(default="local", description="local | k8s")
    local: LocalRunnerConfig = Field(default_factory=LocalRunnerConfig, description="agents as local processes")
    k8s: K8sRunnerConfig = Field(default_factory=K8sRunnerConfig, description="agents as Kubernetes Jobs")
    async_rollout: AsyncRolloutConfig = Field(
        default_factory=AsyncRolloutConfig, description="the rollout window across updates"
    )
    trace_aggregator: TraceAggregatorConfig = Field(
        default_factory=TraceAggregatorConfig, description="how a rollout's model calls become training samples"
    )
    agl_base_url: str | None = Field(
        default=None,
        description="Agent Lightning's gateway URL: rollover train serves its gateway there (sets gateway.host/port)",
    )
    agl_key: str | None = Field(
        default=None, description='Agent Lightning\'s name for gateway.admin_key ("" = generated, as null)'
    )
    hooks: str | None = Field(
        default=None,
        description="Agent Lightning's RolloutHooks file, accepted with no effect: rewards come from reward events",
    )
    reward_fillna_value: float | None = Field(
        default=None, description="Agent Lightning's name for algorithm.reward_fillna_value"
    )
    max_ppo_update_times: int | None = Field(
        default=None,
        gt=0,
        description="Agent Lightning's cap on optimizer steps per update, accepted with no effect: ppo_epochs and ppo_mini_batch_size decide",
    )

    @field_validator("agl_base_url")
    @classmethod
    def _plain_http(cls, value: str | None) -> str | None:
        if value is not None:
            _gateway_address(value)
        return value


class RolloutCorrectionConfig(_Section):
    rollout_is: Literal["token", "sequence"] | None = Field(
        default=None, description="null | token | sequence   (recommended for async: token)"
    )
    rollout_is_threshold: float = Field(default=2.0, gt=0, description="importance weights are truncated here")


class AlgorithmConfig(_Section):
    adv_estimator: Literal["grpo", "rloo"] = Field(default="grpo", description="grpo | rloo")
    enable_rollout_level_advantage: Literal[True] = Field(
        default=True, description="Agent Lightning's key: a rollout's advantage applies to all its samples (always)"
    )
    reward_fillna_value: float = Field(default=0.0, description="reward of a failed rollout or one that reported none")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="off-policy correction of stale samples"
    )


class TrainerConfig(_Section):
    setup_hook: str | None = Field(
        default=None, description='"pkg.module:function" run first; may build data and model (examples use it)'
    )
    project_name: str = Field(default="rollover", description="project name for the loggers")
    experiment_name: str = Field(default="run", description="experiment name for the loggers and the run folder")
    default_local_dir: str = Field(default="runs", description="run folder = <default_local_dir>/<experiment_name>")
    total_training_steps: int = Field(default=10, gt=0, description="updates, then the run ends")
    total_epochs: int | None = Field(
        default=None, gt=0, description="verl's key, accepted and unused: total_training_steps ends the run"
    )
    logger: list[Literal["console", "jsonl", "wandb"]] = Field(
        default=["console", "jsonl"], description="console | jsonl | wandb"
    )
    save_freq: int = Field(default=0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    test_freq: int = Field(default=0, ge=0, description="held-out evaluation every N steps; 0 = before and after only")
    max_failed_steps: int = Field(
        default=3,
        ge=0,
        description="the run stops after this many steps in a row whose every rollout failed; 0 = never",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto | cpu | cuda")
    nnodes: int = Field(default=1, ge=1, description="nodes of the run (torchrun --nnodes)")
    n_gpus_per_node: int = Field(
        default=1, ge=1, description="trainer ranks per node (GPUs; on CPU, processes), each holding an FSDP2 shard"
    )
    seed: int = Field(default=0, description="seed of the update's mini-batch shuffling")

    @property
    def run_dir(self) -> Path:
        return Path(self.default_local_dir) / self.experiment_name


class RolloverConfig(_Section):
    data: DataConfig = Field(default_factory=DataConfig, description="tasks and batch sizes")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description="the policy: model, sampling, update"
    )
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="store REST API and recording proxy")
    agentlightning: AgentLightningConfig = Field(
        default_factory=AgentLightningConfig, description="rollouts and the agents that run them"
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="advantages and corrections")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the run: steps, logging, checkpoints")
    resume: bool = Field(default=False, description="continue the run in the run folder from its last checkpoint")

    @model_validator(mode="after")
    def _rules_across_sections(self) -> RolloverConfig:
        self._adopt_agent_lightning_names()
        self.check_async_window()
        self.check_device_pool()
        return self

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def engines_per_node(self) -> int:
        return self.trainer.n_gpus_per_node // self.actor_rollout_ref.rollout.tensor_model_parallel_size

    def check_device_pool(self) -> None:
        """Each engine takes `tensor_model_parallel_size` of the node's devices, none left over."""
        per_node = self.trainer.n_gpus_per_node
        tp = self.actor_rollout_ref.rollout.tensor_model_parallel_size
        if per_node % tp:
            raise ValueError(
                f"trainer.n_gpus_per_node={per_node} must be a multiple of "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} (engines per node = the quotient)"
            )

    def _adopt_agent_lightning_names(self) -> None:
        """Agent Lightning's names for Rollover keys win when set (`load_config` refuses a
        file that sets both names to different values)."""
        agl = self.agentlightning
        for rollover_key, value in agent_lightning_mapped_values(agl).items():
            section, name = rollover_key.split(".")
            setattr(getattr(self, section), name, value)

    def check_async_window(self) -> None:
        """The seed's rule: an async rollout window is set and larger than the batch."""
        async_cfg = self.agentlightning.async_rollout
        train = self.data.train_batch_size
        window = async_cfg.async_train_batch_size
        if async_cfg.enabled and (window is None or window <= train):
            raise ValueError(
                "agentlightning.async_rollout.async_train_batch_size must be set and greater than "
                f"data.train_batch_size when agentlightning.async_rollout.enabled is true "
                f"(got async_train_batch_size={window}, train_batch_size={train}); "
                f"a good start is {2 * train}"
            )


# -- Agent Lightning's keys --------------------------------------------------------------

# Agent Lightning's name -> Rollover's key it sets (values from `agent_lightning_mapped_values`).
AGENT_LIGHTNING_NAMES: dict[str, tuple[str, ...]] = {
    "agentlightning.agl_base_url": ("gateway.host", "gateway.port"),
    "agentlightning.agl_key": ("gateway.admin_key",),
    "agentlightning.reward_fillna_value": ("algorithm.reward_fillna_value",),
}
# Hydra's composition directives in Agent Lightning's YAML (its `defaults: [ppo_trainer, _self_]`).
HYDRA_DIRECTIVES = ("hydra", "defaults")


def agent_lightning_mapped_values(agl: AgentLightningConfig) -> dict[str, Any]:
    """Rollover's `section.key` -> the value Agent Lightning's names in `agl` give it."""
    values: dict[str, Any] = {}
    if agl.agl_base_url is not None:
        values["gateway.host"], values["gateway.port"] = _gateway_address(agl.agl_base_url)
    if agl.agl_key:  # Agent Lightning's default "" means no key: Rollover generates one
        values["gateway.admin_key"] = agl.agl_key
    if agl.reward_fillna_value is not None:
        values["algorithm.reward_fillna_value"] = agl.reward_fillna_value
    return values


def agent_lightning_notes(config: RolloverConfig) -> list[str]:
    """One line per Agent Lightning / verl key that is accepted but changes nothing here."""
    agl = config.agentlightning
    actor = config.actor_rollout_ref.actor
    no_effect = {
        "agentlightning.hooks": (agl.hooks is not None, "rewards come from the agents' reward events"),
        "agentlightning.max_ppo_update_times": (
            agl.max_ppo_update_times is not None,
            "optimizer steps per update follow actor_rollout_ref.actor.ppo_epochs and ppo_mini_batch_size",
        ),
        "actor_rollout_ref.actor.policy_loss.loss_mode": (
            actor.policy_loss.loss_mode is not None,
            "the policy loss is the token-mean over each mini-batch",
        ),
        "actor_rollout_ref.actor.calculate_entropy": (actor.calculate_entropy, "no entropy metric is computed"),
        "actor_rollout_ref.rollout.mode": (
            config.actor_rollout_ref.rollout.mode == "sync",
            "the engine is always vLLM's OpenAI server (verl's async mode)",
        ),
        "data.filter_overlong_prompts": (
            config.data.filter_overlong_prompts,
            "a sample over its token budget is cut, not filtered",
        ),
    }
    return [
        f"config key '{key}' (Agent Lightning / verl) has no effect in Rollover: {why}"
        for key, (given, why) in no_effect.items()
        if given
    ]


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (the keys a user gave, by their dotted names)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
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


class GatewaySettings(BaseModel):
    """What one gateway process runs with, handed to it whole: the `gateway` section, the two
    temperatures the proxy forces (under `actor_rollout_ref.rollout`) and the response cap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gateway: GatewayConfig = Field(description="the `gateway` section")
    train_temperature: Temperature = Field(description="actor_rollout_ref.rollout.temperature")
    val_temperature: Temperature = Field(description="actor_rollout_ref.rollout.val_kwargs.temperature")
    max_response_tokens: int | None = Field(
        default=None, gt=0, description="data.max_response_length: a call's response is capped here (null = no cap)"
    )
    instance: str | None = Field(
        default=None,
        description="a token /healthz answers with: whoever started this gateway knows the server on the port is it",
    )

    @classmethod
    def from_config(cls, config: RolloverConfig | None = None, **gateway: Any) -> GatewaySettings:
        """The settings of `config` (default: the defaults); `gateway` replaces keys of its
        `gateway` section (e.g. `admin_key="k", max_body_bytes=1000`); raises `ConfigError`."""
        config = config or RolloverConfig()
        rollout = config.actor_rollout_ref.rollout
        settings = cls(
            gateway=config.gateway.model_copy(),
            train_temperature=rollout.temperature,
            val_temperature=rollout.val_kwargs.temperature,
            max_response_tokens=config.data.max_response_length,
        )
        return settings.with_gateway(**gateway)

    def with_gateway(self, **gateway: Any) -> GatewaySettings:
        """A copy with keys of the `gateway` section replaced, validated; raises `ConfigError`."""
        if not gateway:
            return self
        try:
            section = GatewayConfig.model_validate(self.gateway.model_dump() | gateway)
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, "gateway") from None
        return self.model_copy(update={"gateway": section})


# -- loading ------------------------------------------------------------------------------


def _describe(error: ErrorDetails, section: str = "") -> str:
    key = ".".join(str(part) for part in ((section,) if section else ()) + tuple(error["loc"]))
    if not error["loc"]:  # a rule across sections: its message names the keys itself
        return str(error.get("ctx", {}).get("error", error["msg"]))
    if error["type"] == "extra_forbidden":
        return f"unknown config key '{key}'"
    got = error.get("input")
    return f"config key '{key}': {error['msg']} (got {got!r})"


def validate_config(raw: dict[str, Any]) -> RolloverConfig:
    try:
        return RolloverConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError.from_validation(exc) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RolloverConfig:
    """Defaults ← YAML file ← dotlist overrides, validated; raises `ConfigError`."""
    layers = [OmegaConf.create(RolloverConfig().model_dump(mode="json"))]
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
        directives = [key for key in HYDRA_DIRECTIVES if key in loaded]
        if directives:
            log.warning(
                "config keys %s (Hydra's composition) have no effect in Rollover: its own defaults are the base",
                ", ".join(f"'{key}'" for key in directives),
            )
            loaded = {key: value for key, value in loaded.items() if key not in directives}
        layers.append(OmegaConf.create(loaded))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        raw = OmegaConf.to_container(merged, resolve=True)
        user = OmegaConf.to_container(OmegaConf.merge({}, *layers[1:]), resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge config: {exc}") from None
    assert isinstance(raw, dict)
    config = validate_config({str(key): value for key, value in raw.items()})
    assert isinstance(user, dict)
    _check_both_names(_dotted({str(key): value for key, value in user.items()}), config)
    for note in agent_lightning_notes(config):
        log.warning("%s", note)
    return config


def check_async_rollout(config: RolloverConfig) -> None:
    """The seed's async batch-size rule, checked again (the Trainer does, at construction):
    assigning a nested key (`config.agentlightning.async_rollout.enabled = True`) does not
    re-run `RolloverConfig`'s validators. Raises `ValueError` naming both keys and values."""
    config.check_async_window()


def dump_config(config: RolloverConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
