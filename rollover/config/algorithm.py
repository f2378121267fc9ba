"""The `algorithm` section: advantages, KL in the reward, zero-variance groups and rollout
correction, with verl's keys and meanings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollover.config.actor_rollout_ref import KLType
from rollover.config.base import Section

AdvEstimator = Literal["grpo", "rloo"]
KLControlType = Literal["fixed", "adaptive"]
RolloutIsMode = Literal["token", "sequence"]
RejectionMode = Literal["token", "sequence", "geometric"]
CorrectionLossType = Literal["ppo_clip", "reinforce"]
GroupMetric = Literal["score", "acc", "seq_reward", "seq_final_reward"]


class RolloutCorrectionConfig(Section):
    rollout_is: RolloutIsMode | None = Field(
        default=None, description="null | token | sequence   (recommended for async: token)"
    )
    rollout_is_threshold: float = Field(default=2.0, gt=0, description="importance weights are truncated here")
    rollout_is_batch_normalize: bool = Field(
        default=False, description="rescale the truncated weights to mean 1 over the batch"
    )
    rollout_rs: RejectionMode | None = Field(
        default=None,
        description="rejection sampling: null | token | sequence | geometric; a token or sample whose ratio π_old/μ leaves the bounds is not trained",
    )
    rollout_rs_threshold: float | None = Field(
        default=None, gt=0, description="rejection's upper bound of the ratio; null = rollout_is_threshold"
    )
    rollout_rs_threshold_lower: float | None = Field(
        default=None, gt=0, description="rejection's lower bound; null = 1 / rollout_rs_threshold"
    )
    rollout_token_veto_threshold: float | None = Field(
        default=None, gt=0, description="a sample with any token ratio below this is not trained (null = off)"
    )
    bypass_mode: bool = Field(
        default=False,
        description="π_old = the recorded engine logprobs μ: no old-logprob forward pass (two policies, not three)",
    )
    loss_type: CorrectionLossType = Field(
        default="ppo_clip",
        description="ppo_clip | reinforce (bypass mode: -A·logπ·w with w = min(π/μ, rollout_is_threshold) when rollout_is is set)",
    )

    @property
    def rejection_bounds(self) -> tuple[float, float]:
        """The ratio bounds of rejection sampling: (lower, upper)."""
        upper = self.rollout_rs_threshold or self.rollout_is_threshold
        return self.rollout_rs_threshold_lower or 1.0 / upper, upper

    @model_validator(mode="after")
    def _bounds_ordered(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None:
            lower, upper = self.rejection_bounds
            if lower >= upper:
                raise ValueError(
                    "algorithm.rollout_correction.rollout_rs_threshold_lower must be below rollout_rs_threshold "
                    f"(got {lower} and {upper})"
                )
        return self


class KLControlConfig(Section):
    type: KLControlType = Field(default="fixed", description="fixed | adaptive (Ziegler et al.: toward target_kl)")
    kl_coef: float = Field(default=0.001, ge=0, description="KL-in-reward coefficient (adaptive: its start)")
    horizon: int = Field(default=10000, gt=0, description="adaptive: samples over which the coefficient adapts")
    target_kl: float = Field(default=0.1, gt=0, description="adaptive: the KL the coefficient steers toward")


class FilterGroupsConfig(Section):
    enable: bool = Field(
        default=False,
        description="DAPO dynamic sampling: a complete group whose members all score alike is not trained on nor counted; the window tops up in its place",
    )
    metric: GroupMetric | None = Field(
        default=None,
        description="what must differ within a group: score (= seq_reward, the reward; default) | acc (reward > 0)",
    )
    max_num_gen_batches: int = Field(
        default=0,
        ge=0,
        description="a step gives up after filtering this many batches' worth of groups (x data.train_batch_size); 0 = no bound",
    )


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = Field(default="grpo", description="grpo | rloo")
    norm_adv_by_std_in_grpo: bool = Field(
        default=True, description="GRPO divides by the group's std; false = Dr. GRPO (centred only)"
    )
    enable_rollout_level_advantage: Literal[True] = Field(
        default=True, description="Agent Lightning's key: a rollout's advantage applies to all its samples (always)"
    )
    reward_fillna_value: float = Field(default=0.0, description="reward of a failed rollout or one that reported none")
    use_kl_in_reward: bool = Field(
        default=False, description="subtract kl_ctrl's coefficient x KL(π_old || π_ref) from each rollout's reward"
    )
    kl_penalty: KLType = Field(default="kl", description="the KL estimator of use_kl_in_reward (names as kl_loss_type)")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description="the KL-in-reward coefficient")
    filter_groups: FilterGroupsConfig = Field(
        default_factory=FilterGroupsConfig, description="zero-variance groups (DAPO dynamic sampling)"
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="off-policy correction of stale samples"
    )
