"""The `agentlightning` section: rollouts, the agents that run them, the async window."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rollover.config.base import Section


class LocalRunnerConfig(Section):
    agent_class: str | None = Field(
        default=None, description='"pkg.module:Class" (or Agent Lightning\'s "pkg.module.Class") with a run() method'
    )
    env_map: dict[str, str] = Field(default={}, description="ENV_NAME: input.path")
    env: dict[str, str] = Field(
        default={},
        description="ENV_NAME: value set for every agent process, on top of the allowlisted base (PATH, LANG, LC_*, TZ, TERM, JAVA_HOME, VIRTUAL_ENV, HOME, TMPDIR)",
    )
    max_concurrency: int = Field(default=64, gt=0, description="agent processes running at once")
    start_method: Literal["forkserver", "spawn"] = Field(
        default="forkserver",
        description="forkserver: fork agents from a process that imported the SDK once; spawn: a fresh interpreter each",
    )
    sandbox: bool = Field(
        default=True,
        description="run each agent in a bubblewrap sandbox: its own user/PID/network namespaces, a scratch /tmp, the filesystem read-only without the run's folder, only the gateway reachable (false: as the controller's user, with its files and network)",
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


class K8sRunnerConfig(Section):
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


class AsyncRolloutConfig(Section):
    enabled: bool = Field(default=False, description="default: synchronous")
    async_train_batch_size: int | None = Field(
        default=None, gt=0, description="active prompt groups; required and > train_batch_size when enabled"
    )
    max_carry_over_age_steps: int | None = Field(
        default=None,
        ge=0,
        description="abort and re-queue groups older than this many updates (partial_rollout: counted from their oldest token)",
    )
    partial_rollout: bool = Field(
        default=False,
        description="async only: an update neither drains nor refuses agent calls; the engine freezes them across the weight load and continues them with the new weights, each token recorded with its version",
    )

    @model_validator(mode="after")
    def _partial_needs_async(self) -> AsyncRolloutConfig:
        if self.partial_rollout and not self.enabled:
            raise ValueError(
                "agentlightning.async_rollout.partial_rollout=true needs agentlightning.async_rollout.enabled=true"
                " (a synchronous step waits for every rollout anyway)"
            )
        return self


def gateway_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"must be an http://host:port URL (Rollover's gateway serves plain HTTP), got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"has a bad port: {url!r}") from None
    return parts.hostname, port if port is not None else 80


class TraceAggregatorConfig(Section):
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


POLICY_NAME = r"[A-Za-z][A-Za-z0-9_]{0,62}"


class PolicyConfig(Section):
    """One of several policies trained in one run: a LoRA adapter of its own over the shared
    base, served by the same engines; an agent picks it by the `model` it asks for."""

    lr: float | None = Field(
        default=None, gt=0, description="its learning rate; null = actor_rollout_ref.actor.optim.lr"
    )


class AgentLightningConfig(Section):
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
        description="Agent Lightning's RolloutHooks file; rewards come from the agents' reward events here",
    )
    reward_fillna_value: float | None = Field(
        default=None, description="Agent Lightning's name for algorithm.reward_fillna_value"
    )
    max_ppo_update_times: int | None = Field(
        default=None,
        gt=0,
        description="Agent Lightning's cap on optimizer steps per update epoch: samples beyond max x mini-batch are dropped (groups whose rewards are all alike first)",
    )

    policies: dict[str, PolicyConfig] = Field(
        default={},
        description="several policies in one run (needs actor_rollout_ref.model.lora_rank > 0): name -> {lr}; an agent asks for one by its name as the model; {} = one policy",
    )

    @field_validator("policies")
    @classmethod
    def _policy_names(cls, value: dict[str, PolicyConfig]) -> dict[str, PolicyConfig]:
        for name in value:
            if not re.fullmatch(POLICY_NAME, name):
                raise ValueError(
                    f"policy name {name!r} must start with a letter and hold only letters, digits and '_'"
                    " (it is the model name agents ask for; the engine serves it as '<name>-v<version>')"
                )
        return value

    @field_validator("agl_base_url")
    @classmethod
    def _plain_http(cls, value: str | None) -> str | None:
        if value is not None:
            gateway_address(value)
        return value
