"""`RolloverConfig`: the sections together and the rules that cross them."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from rollover.config.actor_rollout_ref import ActorRolloutRefConfig
from rollover.config.agentlightning import AgentLightningConfig, gateway_address
from rollover.config.algorithm import AlgorithmConfig
from rollover.config.base import Section
from rollover.config.data import DataConfig
from rollover.config.gateway import GatewayConfig
from rollover.config.loss_choice import LossChoice, resolve_loss
from rollover.config.trainer import TrainerConfig


class RolloverConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig, description="tasks and batch sizes")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description="the policy: model, sampling, update"
    )
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="store REST API and recording proxy")
    agentlightning: AgentLightningConfig = Field(
        default_factory=AgentLightningConfig, description="rollouts and the agents that run them"
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="advantages, KL in the reward, filters and corrections"
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the run: steps, logging, checkpoints")
    resume: bool = Field(default=False, description="continue the run in the run folder from its last checkpoint")

    @model_validator(mode="before")
    @classmethod
    def _adopt_agent_lightning_names(cls, data: Any) -> Any:
        """Agent Lightning's names for Rollover keys win when set (`load_config` refuses a file
        that sets both names to different values): the input is rewritten before validation,
        never the validated model."""
        if not isinstance(data, dict) or not isinstance(data.get("agentlightning"), dict):
            return data
        try:
            agl = AgentLightningConfig.model_validate(data["agentlightning"])
        except ValidationError:
            return data  # validation proper reports it, naming the key
        mapped = agent_lightning_mapped_values(agl)
        if not mapped:
            return data
        adopted = dict(data)
        for rollover_key, value in mapped.items():
            section, name = rollover_key.split(".")
            given = adopted.get(section)
            if isinstance(given, BaseModel):
                given = given.model_dump()
            adopted[section] = {**(given or {}), name: value}
        return adopted

    @model_validator(mode="after")
    def _rules_across_sections(self) -> RolloverConfig:
        self.check_async_window()
        self.check_device_pool()
        self.check_lora()
        self.check_kl_horizon()
        self.check_update()
        return self

    def check_kl_horizon(self) -> None:
        """The adaptive KL coefficient moves by up to 20% x rollouts per update / horizon each
        update: past 100% it would turn negative (a bonus for drifting from the reference)."""
        ctrl = self.algorithm.kl_ctrl
        if ctrl.type != "adaptive":
            return
        window = self.agentlightning.async_rollout.async_train_batch_size or self.data.train_batch_size
        per_update = window * self.actor_rollout_ref.rollout.n
        if 0.2 * per_update >= ctrl.horizon:
            raise ValueError(
                f"algorithm.kl_ctrl.horizon={ctrl.horizon} is too small: with up to {per_update} rollouts per update"
                f" the adaptive coefficient could turn negative; it must exceed {math.ceil(0.2 * per_update)}"
            )

    @property
    def loss(self) -> LossChoice:
        """The loss an update computes (`loss_choice.resolve_loss`)."""
        actor, correction = self.actor_rollout_ref.actor, self.algorithm.rollout_correction
        return resolve_loss(
            actor.policy_loss.loss_mode, actor.loss_agg_mode, correction.loss_type, correction.bypass_mode
        )

    def check_update(self) -> None:
        """The loss keys make one loss, and the estimator has what it needs."""
        self.loss  # noqa: B018  # raises on a combination that means nothing
        estimator, n = self.algorithm.adv_estimator, self.actor_rollout_ref.rollout.n
        if estimator == "grpo_passk" and n < 2:
            raise ValueError(
                f"algorithm.adv_estimator=grpo_passk gives the best of each group r_max - r_second: "
                f"actor_rollout_ref.rollout.n must be at least 2 (got {n})"
            )
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode and correction.rollout_is_batch_normalize and correction.loss_type == "reinforce":
            raise ValueError(
                "algorithm.rollout_correction.rollout_is_batch_normalize=true with bypass_mode=true: the IS weights are "
                "taken per micro-batch there, so their mean would depend on the micro-batching; set one of them false"
            )
        if estimator == "optimal_token_baseline" and correction.bypass_mode:
            raise ValueError(
                "algorithm.adv_estimator=optimal_token_baseline weighs each token by π_old's Σπ² from the π_old "
                "forward pass, which algorithm.rollout_correction.bypass_mode=true skips: set one of them otherwise"
            )

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def engines_per_node(self) -> int:
        return self.trainer.n_gpus_per_node // self.actor_rollout_ref.rollout.tensor_model_parallel_size

    @property
    def response_budget(self) -> int:
        """A sample's token budget after its first prompt (the trajectory level's own budget)."""
        aggregator = self.agentlightning.trace_aggregator
        if aggregator.level == "trajectory" and aggregator.trajectory_max_response_length is not None:
            return aggregator.trajectory_max_response_length
        return self.data.max_response_length

    @property
    def needs_reference(self) -> bool:
        """A KL term needs the frozen reference policy's logprobs."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def old_logprob_micro_batch_size(self) -> int:
        """Samples per forward pass when π_old is recomputed, on one rank."""
        rollout = self.actor_rollout_ref.rollout
        return self._per_rank(rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_micro_batch_size) or (
            self.actor_rollout_ref.actor.micro_batch_size
        )

    @property
    def ref_logprob_micro_batch_size(self) -> int:
        """Samples per forward pass of the reference policy, on one rank."""
        ref = self.actor_rollout_ref.ref
        return self._per_rank(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_micro_batch_size) or (
            self.actor_rollout_ref.actor.micro_batch_size
        )

    def _per_rank(self, per_gpu: int | None, global_size: int | None) -> int | None:
        if per_gpu is not None:
            return per_gpu
        return None if global_size is None else max(1, global_size // self.world_size)

    def check_device_pool(self) -> None:
        """Each engine takes `tensor_model_parallel_size` of the node's devices, none left over."""
        per_node = self.trainer.n_gpus_per_node
        tp = self.actor_rollout_ref.rollout.tensor_model_parallel_size
        if per_node % tp:
            raise ValueError(
                f"trainer.n_gpus_per_node={per_node} must be a multiple of "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} (engines per node = the quotient)"
            )

    def check_lora(self) -> None:
        """A LoRA engine serves one adapter per policy version; partial rollout's requests kept
        across a load would go on with the old adapter, so the two do not mix (yet)."""
        model, policies = self.actor_rollout_ref.model, self.agentlightning.policies
        if policies and not model.lora:
            raise ValueError(
                "agentlightning.policies needs actor_rollout_ref.model.lora_rank > 0: each policy is a LoRA adapter"
            )
        if policies and model.lora_adapter_path is not None:
            raise ValueError(
                "actor_rollout_ref.model.lora_adapter_path starts one adapter; with agentlightning.policies each"
                " policy starts from a fresh one (leave lora_adapter_path null)"
            )
        max_loras = self.actor_rollout_ref.rollout.max_loras
        if len(policies) > max_loras:
            raise ValueError(
                f"actor_rollout_ref.rollout.max_loras={max_loras} is fewer than the {len(policies)} policies of"
                f" agentlightning.policies: the engine must run every policy's adapter at once; set it to {len(policies)}"
            )

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


# Agent Lightning's name -> Rollover's key it sets (values from `agent_lightning_mapped_values`).
AGENT_LIGHTNING_NAMES: dict[str, tuple[str, ...]] = {
    "agentlightning.agl_base_url": ("gateway.host", "gateway.port"),
    "agentlightning.agl_key": ("gateway.admin_key",),
    "agentlightning.reward_fillna_value": ("algorithm.reward_fillna_value",),
}


def agent_lightning_mapped_values(agl: AgentLightningConfig) -> dict[str, Any]:
    """Rollover's `section.key` -> the value Agent Lightning's names in `agl` give it."""
    values: dict[str, Any] = {}
    if agl.agl_base_url is not None:
        values["gateway.host"], values["gateway.port"] = gateway_address(agl.agl_base_url)
    if agl.agl_key:  # Agent Lightning's default "" means no key: Rollover generates one
        values["gateway.admin_key"] = agl.agl_key
    if agl.reward_fillna_value is not None:
        values["algorithm.reward_fillna_value"] = agl.reward_fillna_value
    return values
