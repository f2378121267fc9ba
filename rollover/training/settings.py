"""What the training loop runs with: `TrainerSettings`, built once from the config.

The loop (`Trainer`) reads no key of the whole config: everything it needs is here, resolved
(the async window, the run's length, each sample's token budget, the learning-rate schedule's
shape), and frozen. Building it checks the rules across sections the loop depends on, so a
config changed after it was loaded (`config.agentlightning.async_rollout.enabled = True`, which
pydantic validates key by key only) still fails with the seed's message here, where the
Trainer is constructed.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollover.config import RolloverConfig, ScheduleKind
from rollover.config.algorithm import GroupMetric, KLControlType
from rollover.config.data import Truncation


@dataclass(frozen=True)
class SampleBudget:
    """How a rollout's calls become samples (`agentlightning.trace_aggregator`, `data.*`)."""

    max_length: int  # a sample's tokens, prompt and responses together
    merge: bool  # trajectory level: calls that extend a sample continue it
    truncation: Truncation  # what an over-long sample loses (error: it is not trained)
    response_budget: int  # a sample's tokens after its first prompt (clipped-response metric)

    @classmethod
    def from_config(cls, config: RolloverConfig) -> SampleBudget:
        data, aggregator = config.data, config.agentlightning.trace_aggregator
        if aggregator.level == "transition":
            max_length, merge = data.max_prompt_length + data.max_response_length, False
        else:
            max_length = (aggregator.trajectory_max_prompt_length or data.max_prompt_length) + (
                aggregator.trajectory_max_response_length or data.max_response_length
            )
            if aggregator.trajectory_max_total_length is not None:
                max_length = min(max_length, aggregator.trajectory_max_total_length)
            merge = True
        return cls(max_length, merge, data.truncation, config.response_budget)


@dataclass(frozen=True)
class LearningRate:
    """The actor's learning-rate schedule (`actor_rollout_ref.actor.optim`)."""

    peak: float
    warmup_steps: int  # -1: `warmup_ratio` of the run decides
    warmup_ratio: float
    kind: ScheduleKind
    min_lr_ratio: float
    num_cycles: float


@dataclass(frozen=True)
class KLInReward:
    """`algorithm.use_kl_in_reward` and its coefficient's controller (`algorithm.kl_ctrl`)."""

    enabled: bool
    controller: KLControlType
    initial_coef: float
    target_kl: float
    horizon: int


@dataclass(frozen=True)
class TrainerSettings:
    """The training loop's settings (see the module's docstring)."""

    train_batch_size: int  # complete groups one update consumes
    window: int  # groups kept in flight: async_train_batch_size (async) or train_batch_size
    rollout_n: int  # rollouts per group
    async_enabled: bool
    partial_rollout: bool  # async only: updates neither drain nor refuse calls
    max_carry_over_age_steps: int | None
    rollout_timeout_seconds: float
    filter_groups: bool  # zero-variance groups leave the window (DAPO's dynamic sampling)
    filter_metric: GroupMetric | None
    max_filtered_groups: int | None  # a step gives up past this many filtered groups (None: never)
    reward_fillna_value: float
    retry_after_seconds: float  # announced to agents refused during a pause
    drain_timeout_seconds: float
    samples: SampleBudget
    learning_rate: LearningRate
    kl_in_reward: KLInReward
    ppo_epochs: int
    max_failed_steps: int
    val_batch_size: int
    val_before_train: bool
    test_freq: int
    save_freq: int
    total_training_steps: int | None
    total_epochs: int | None
    data_seed: int
    seed: int

    @classmethod
    def from_config(cls, config: RolloverConfig) -> TrainerSettings:
        """The loop's settings; raises `ValueError` naming both keys when the async window is
        missing or not larger than `data.train_batch_size` (the seed's rule)."""
        config.check_async_window()
        agl, algorithm, data, trainer = config.agentlightning, config.algorithm, config.data, config.trainer
        async_rollout, optim = agl.async_rollout, config.actor_rollout_ref.actor.optim
        window = async_rollout.async_train_batch_size if async_rollout.enabled else None
        filters = algorithm.filter_groups
        return cls(
            train_batch_size=data.train_batch_size,
            window=window or data.train_batch_size,
            rollout_n=config.actor_rollout_ref.rollout.n,
            async_enabled=async_rollout.enabled,
            partial_rollout=async_rollout.enabled and async_rollout.partial_rollout,
            max_carry_over_age_steps=async_rollout.max_carry_over_age_steps,
            rollout_timeout_seconds=agl.rollout_timeout_seconds,
            filter_groups=filters.enable,
            filter_metric=filters.metric,
            max_filtered_groups=filters.max_num_gen_batches * data.train_batch_size or None,
            reward_fillna_value=algorithm.reward_fillna_value,
            retry_after_seconds=config.gateway.retry_after_seconds,
            drain_timeout_seconds=config.gateway.drain_timeout_seconds,
            samples=SampleBudget.from_config(config),
            learning_rate=LearningRate(
                optim.lr,
                optim.lr_warmup_steps,
                optim.lr_warmup_steps_ratio,
                optim.schedule,
                optim.min_lr_ratio,
                optim.num_cycles,
            ),
            kl_in_reward=KLInReward(
                algorithm.use_kl_in_reward,
                algorithm.kl_ctrl.type,
                algorithm.kl_ctrl.kl_coef,
                algorithm.kl_ctrl.target_kl,
                algorithm.kl_ctrl.horizon,
            ),
            ppo_epochs=config.actor_rollout_ref.actor.ppo_epochs,
            max_failed_steps=trainer.max_failed_steps,
            val_batch_size=data.val_batch_size,
            val_before_train=trainer.val_before_train,
            test_freq=trainer.test_freq,
            save_freq=trainer.save_freq,
            total_training_steps=trainer.total_training_steps,
            total_epochs=trainer.total_epochs,
            data_seed=data.seed,
            seed=trainer.seed,
        )

    def total_steps(self, n_train_tasks: int) -> int:
        """Updates of the run: `total_training_steps`, else `total_epochs` passes over the tasks."""
        if self.total_training_steps is not None:
            return self.total_training_steps
        return (self.total_epochs or 1) * max(1, -(-n_train_tasks // self.train_batch_size))
