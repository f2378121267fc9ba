"""The trainable policy and one update (SPEC §5) over the samples of complete groups.

One update, in the order `run_update` takes it (every rank runs it on the same `UpdatePlan`):

1. π_old, recomputed once with no gradient (each rank its share, then gathered), or in
   bypass mode the recorded engine logprobs μ (`algorithm.rollout_correction.bypass_mode`).
2. π_ref, when a KL term needs it (`reference.ReferencePolicy`).
3. Advantages per rollout: its reward, less β·KL(π_old‖π_ref) when the KL is in the reward,
   normalised within its group (`advantages`); every sample of the rollout carries it.
4. Rollout correction over the whole batch: IS weights and rejection masks from π_old vs μ
   (in bypass mode they are taken per micro-batch against π_θ, as verl does).
5. The optimizer steps. One mini-batch's loss is the policy loss aggregated over the whole
   mini-batch (`loss.aggregate`: counts of all its micro-batches on all ranks), minus
   `entropy_coeff`·entropy, plus `kl_loss_coef`·KL(π_θ‖π_ref); so N ranks and any
   micro-batching take the step one rank with the whole mini-batch would.

With several policies (`agentlightning.policies`, each a LoRA adapter) every sample is its
policy's: π_old goes through its own adapter, advantages are normalised within (group, policy),
and each optimizer step trains one policy's mini-batch at that policy's learning rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollover.config import RolloverConfig
from rollover.distributed import sharding
from rollover.distributed.world import World
from rollover.metrics.progress import NullProgress, Progress
from rollover.training import lora
from rollover.training.advantages import compute_advantages, penalised_scores, policy_unit, policy_units
from rollover.training.forward import Batching, per_sample_logprobs, rank_passes
from rollover.training.logprobs import logprobs_and_entropy
from rollover.training.loss.aggregate import (
    BatchCounts,
    aggregate,
    local_counts,
    per_rollout_mean,
    rollout_row_divisors,
)
from rollover.training.loss.correction import importance_weights, rejection_mask
from rollover.training.loss.kl import kl_estimate
from rollover.training.loss.policy import POLICY_LOSSES, ClipRange, PolicyLossInputs
from rollover.training.reference import AdapterOffReference, ReferencePolicy
from rollover.training.samples import RolloutScore, Sample, UpdateBatch, collate, pad_rows
from rollover.vision.model import auto_model_class, copy_processor, freeze_vision_tower


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


@dataclass
class UpdatePlan:
    """One update, decided on rank 0: the samples, the rollouts they came from (advantages are
    computed in the update), the indices of each optimizer step's mini-batch (the shuffles of
    every PPO epoch), the learning rate and the KL-in-reward coefficient of this update."""

    samples: list[Sample]
    rollouts: list[RolloutScore]
    steps: list[list[int]]
    lr: float
    kl_coef: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # what planning dropped


@dataclass
class Prepared:
    """One sample with what the update computed for it before the optimizer steps
    (target-aligned, ``[len - 1]``, on the host)."""

    sample: Sample
    old: torch.Tensor  # log π_old; bypass mode: log μ (NaN where none was recorded)
    ref: torch.Tensor | None = None  # log π_ref, when a KL term needs it
    is_weights: torch.Tensor | None = None  # decoupled rollout correction's truncated IS weights
    keep: torch.Tensor | None = None  # decoupled rejection sampling: 1 = trained
    divisor: float = 1.0  # per_rollout_mean's row divisor


@dataclass
class MicroBatchResult:
    loss: torch.Tensor
    sums: dict[str, float]  # Σ over trained tokens, divided by the mini-batch's count later
    shares: dict[str, float]  # this micro-batch's share of a mini-batch value (summed later)


class Policy:
    """A causal LM with its tokenizer and optimizer, on this rank's device (sharded over the
    ranks when there are several), and the frozen reference when a KL term needs one."""

    progress: Progress = NullProgress()  # told of each optimizer step (from the update's thread)
    world: World = World()  # one rank unless given
    policies: tuple[str, ...] = ()  # several policies' names (agentlightning.policies); () = one
    lr_scales: tuple[float, ...] = (1.0,)  # each optimizer parameter group's lr / the actor's

    def __init__(self, model_path: str | Path, config: RolloverConfig, world: World | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_path = Path(model_path)
        self.world = world or World()
        self.device = self.world.device(config.trainer.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = auto_model_class(model_path).from_pretrained(model_path, dtype=torch.float32).to(self.device)
        model.config.use_cache = False
        if config.actor_rollout_ref.model.freeze_vision_tower:
            freeze_vision_tower(model)
        if config.actor_rollout_ref.model.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.lora = config.actor_rollout_ref.model.lora
        self.policies = tuple(config.agentlightning.policies)
        if self.lora:  # before sharding: FSDP2 shards the adapter with its layer
            model = lora.wrap(
                model, config.actor_rollout_ref.model, model_path, seed=config.trainer.seed, policies=self.policies
            )
        if self.world.distributed:
            fsdp = config.actor_rollout_ref.actor.fsdp_config
            mixed = fsdp.mixed_precision == "bf16" or (fsdp.mixed_precision == "auto" and self.device.type == "cuda")
            model = sharding.shard_model(
                model, mixed_precision=mixed, offload=fsdp.param_offload or fsdp.optimizer_offload
            )
        self.model = model
        optim = config.actor_rollout_ref.actor.optim
        # With LoRA only the adapter is trainable: the base has no gradients and no Adam state.
        # Several policies: a parameter group per policy's adapter, its lr a multiple of the
        # actor's (so the lr schedule scales every policy's alike).
        self.lr_scales = tuple(
            (config.agentlightning.policies[name].lr or optim.lr) / optim.lr for name in self.policies
        ) or (1.0,)
        groups = (
            [{"params": lora.adapter_parameters(self.model, name)} for name in self.policies]
            if self.policies
            else [{"params": [p for p in self.model.parameters() if p.requires_grad]}]
        )
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas)
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = optim.lr * scale
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        # The reference is the model this run starts from (a resumed run's base, not its
        # checkpoint: launch loads the checkpoint's weights after building the policy); with
        # LoRA, the base under the policy's own adapter, disabled.
        self.reference: ReferencePolicy | AdapterOffReference | None = None
        if config.needs_reference:
            self.reference = (
                AdapterOffReference(self.model, config, self.world, self.device)
                if self.lora
                else ReferencePolicy(model_path, config, self.world, self.device)
            )

    # -- weights and checkpoints (collectives on several ranks) ----------------------------

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]:
        return sharding.full_state_dict(self.model, keep=keep)

    def save_adapter(self, directory: str | Path, *, write: bool) -> None:
        """LoRA: the adapter alone, gathered (a collective on several ranks), as a PEFT folder
        written by the ranks with `write`."""
        if not self.policies:
            state = lora.adapter_state_dict(self.model, keep=write)
            if write:
                lora.write_adapter(state, self.model, directory)
            return
        for name in self.policies:  # the same order on every rank: each is a collective
            state = lora.adapter_state_dict(self.model, keep=write, name=name)
            if write:
                lora.write_adapter(state, self.model, Path(directory) / name, name)

    def save(self, directory: str | Path) -> Path:
        """The model as a Hugging Face folder (weights, config, tokenizer), written by rank 0;
        with LoRA the adapter as a PEFT folder (with the tokenizer) instead: the base never
        changes (`rollover model merge` makes one model of the two)."""
        directory = Path(directory)
        if self.lora:
            self.save_adapter(directory, write=self.world.is_leader)
            if self.world.is_leader:
                self.tokenizer.save_pretrained(directory)
                copy_processor(self.model_path, directory)
            return directory
        if not self.world.distributed:
            self.model.save_pretrained(directory, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
            copy_processor(self.model_path, directory)
            return directory
        weights = self.full_state_dict(keep=self.world.is_leader)
        if self.world.is_leader:
            from safetensors.torch import save_file

            directory.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
            copy_processor(self.model_path, directory)
        return directory

    def save_training_state(self, directory: str | Path) -> None:
        """Model and optimizer, sharded (`torch.distributed.checkpoint`), loadable on any
        number of ranks; with LoRA the adapter and its optimizer state only."""
        sharding.save_training_state(self.model, self.optimizer, Path(directory), trainable_only=self.lora)

    def load_training_state(self, directory: str | Path) -> None:
        sharding.load_training_state(self.model, self.optimizer, Path(directory), trainable_only=self.lora)

    # -- planning (rank 0) ----------------------------------------------------------------

    def plan(self, batch: UpdateBatch, rng: random.Random, *, lr: float, kl_coef: float = 0.0) -> UpdatePlan:
        """The samples with targets (capped by `agentlightning.max_ppo_update_times`) and each
        optimizer step's mini-batch; `rng` shuffles each PPO epoch (it is the trainer's,
        checkpointed)."""
        kept = [s for s in batch.samples if s.num_target_tokens > 0]
        no_policy = 0
        if self.policies:  # a call no policy answered (e.g. before the adapters were served) trains none
            no_policy = sum(s.policy not in self.policies for s in kept)
            kept = [s for s in kept if s.policy in self.policies]
        mini = self._mini_batch_samples(len(kept))
        kept, dropped = self._cap_update_times(kept, batch.rollouts, mini, rng)
        if self.policies:
            dropped["training/n_sample_dropped/no_policy"] = float(no_policy)
        steps: list[list[int]] = []
        for _ in range(self.config.actor_rollout_ref.actor.ppo_epochs):
            order = list(range(len(kept)))
            rng.shuffle(order)
            # Several policies: each mini-batch is one policy's (each step moves one adapter).
            parts = [[i for i in order if kept[i].policy == name] for name in self.policies] or [order]
            steps += [part[start : start + mini] for part in parts for start in range(0, len(part), mini)]
        return UpdatePlan(kept, list(batch.rollouts), steps, lr, kl_coef, dropped)

    def update(self, batch: UpdateBatch, rng: random.Random, *, lr: float, kl_coef: float = 0.0) -> dict[str, float]:
        """One update on this rank alone (see `run_update`)."""
        return self.run_update(self.plan(batch, rng, lr=lr, kl_coef=kl_coef))

    def _mini_batch_samples(self, n_samples: int) -> int:
        """Samples per optimizer step: `ppo_mini_batch_size` counts prompts, as in verl, each
        with `rollout.n` samples (the whole batch when null)."""
        config = self.config.actor_rollout_ref
        prompts = config.actor.ppo_mini_batch_size
        return max(1, n_samples if prompts is None else prompts * config.rollout.n)

    def _cap_update_times(
        self, samples: list[Sample], rollouts: Sequence[RolloutScore], mini: int, rng: random.Random
    ) -> tuple[list[Sample], dict[str, float]]:
        """Agent Lightning's `max_ppo_update_times`: at most that many mini-batches per epoch;
        the samples beyond are dropped, those of groups whose rewards are all alike (no
        signal) first, then at random."""
        cap = self.config.agentlightning.max_ppo_update_times
        n_drop = 0 if cap is None else max(0, len(samples) - mini * cap)
        metrics = {"training/n_sample_dropped/same_reward": 0.0, "training/n_sample_dropped/random": 0.0}
        if n_drop == 0:
            return samples, metrics
        rewards: dict[str, set[float]] = {}
        for rollout in rollouts:
            rewards.setdefault(rollout.group_id, set()).add(rollout.reward)
        alike = [i for i, s in enumerate(samples) if len(rewards.get(s.group_id, ())) <= 1]
        rng.shuffle(alike)
        drop = set(alike[:n_drop])
        others = [i for i in range(len(samples)) if i not in drop]
        rng.shuffle(others)
        n_random = n_drop - len(drop)
        drop.update(others[:n_random])
        metrics["training/n_sample_dropped/same_reward"] = float(n_drop - n_random)
        metrics["training/n_sample_dropped/random"] = float(n_random)
        return [s for i, s in enumerate(samples) if i not in drop], metrics

    # -- the update (every rank) ----------------------------------------------------------

    @property
    def _temperature(self) -> float:
        # vLLM records processed logprobs (after temperature: the distribution it sampled
        # from, see VLLMEngine's logprobs_mode), so π is computed at the same temperature.
        return self.config.actor_rollout_ref.rollout.temperature or 1.0

    @property
    def _bypass(self) -> bool:
        return self.config.algorithm.rollout_correction.bypass_mode

    def run_update(self, plan: UpdatePlan) -> dict[str, float]:
        """The plan's optimizer steps, on every rank at once; returns token-weighted metrics
        (the rollout correction's and the advantages' are the whole batch's), the same on
        every rank."""
        if not plan.samples:
            return {}
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = plan.lr * scale
        prepared = self._prepare(plan.samples)
        metrics = dict(plan.metrics)
        metrics |= self._assign_advantages(prepared, plan.rollouts, plan.kl_coef)
        metrics |= self._decoupled_correction(prepared)
        self._assign_divisors(prepared)

        # Token-weighted over every step, and with several policies over each policy's steps.
        sums: dict[str, dict[str, float]] = {}
        tokens_by: dict[str, int] = {}
        self.progress.update(0, len(plan.steps))
        skipped = 0
        for done, indices in enumerate(plan.steps, start=1):
            chunk = [prepared[i] for i in indices]
            step_metrics, tokens, stepped = self._optimizer_step(chunk)
            skipped += not stepped
            for prefix in [""] + ([f"policy/{chunk[0].sample.policy}/"] if self.policies else []):
                into = sums.setdefault(prefix, {})
                for key, value in step_metrics.items():
                    into[key] = into.get(key, 0.0) + value * tokens
                tokens_by[prefix] = tokens_by.get(prefix, 0) + tokens
            self.progress.update(done, len(plan.steps))
        averaged = {
            prefix + key: value / max(tokens_by[prefix], 1)
            for prefix, into in sums.items()
            for key, value in into.items()
        }
        # Settings are reported as set, not through the token mean (float sums move a
        # constant in its last bits); skipped steps are a count.
        settings = {"actor/lr": plan.lr, "actor/n_skipped_steps": float(skipped)}
        if self.config.actor_rollout_ref.actor.use_kl_loss:
            settings["actor/kl_coef"] = self.config.actor_rollout_ref.actor.kl_loss_coef
        return averaged | settings | metrics

    def _batching(self, *, old_logprobs: bool = False) -> Batching:
        actor = self.config.actor_rollout_ref.actor
        if old_logprobs:
            rollout = self.config.actor_rollout_ref.rollout
            budget = rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None
            return Batching(self.config.old_logprob_micro_batch_size, budget)
        return Batching(actor.micro_batch_size, actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None)

    def _prepare(self, samples: Sequence[Sample]) -> list[Prepared]:
        """π_old (or μ in bypass mode) and π_ref for every sample, each on every rank."""
        if self._bypass:
            old = [torch.tensor(s.behaviour_logprobs[1:], dtype=torch.float32) for s in samples]
        else:
            old = self._old_logprobs(samples)
        refs: list[torch.Tensor | None] = [None] * len(samples)
        if self.reference is not None:
            refs = list(self.reference.logprobs(samples, self.pad_token_id, self._temperature))
        return [Prepared(sample, o, r) for sample, o, r in zip(samples, old, refs)]

    def _old_logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """log π_old of every sample, each through its own policy's adapter (every rank runs
        the same passes in the same order: they are collectives)."""
        parts = [[i for i, s in enumerate(samples) if s.policy == name] for name in self.policies]
        old: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        names: list[str | None] = [*self.policies] or [None]
        for name, indices in zip(names, parts or [list(range(len(samples)))]):
            if not indices:
                continue
            if name is not None:
                lora.activate(self.model, name)
            computed = per_sample_logprobs(
                self.model,
                [samples[i] for i in indices],
                pad_token_id=self.pad_token_id,
                temperature=self._temperature,
                world=self.world,
                device=self.device,
                batching=self._batching(old_logprobs=True),
            )
            for i, logprobs in zip(indices, computed):
                old[i] = logprobs
        return old

    def _units(self, prepared: Sequence[Prepared], rollouts: Sequence[RolloutScore]) -> list[RolloutScore]:
        """What advantages are normalised over: the rollouts, or with several policies each
        (rollout, policy) that has samples (`policy_units`)."""
        if not self.policies:
            return list(rollouts)
        return policy_units(rollouts, self.policies, {(p.sample.rollout_id, p.sample.policy) for p in prepared})

    def _unit_of(self, sample: Sample) -> str:
        return policy_unit(sample.rollout_id, sample.policy) if self.policies else sample.rollout_id

    def _batch_tensors(self, prepared: Sequence[Prepared]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole batch, padded: loss mask, π_old and μ (π_old where no logprobs were
        recorded, so such a token's ratio is 1)."""
        batch = collate([p.sample for p in prepared], self.pad_token_id)
        mask = batch["loss_mask"]
        old = pad_rows([p.old for p in prepared], mask.shape[1])
        behaviour = batch["behaviour_logprobs"]
        return mask, old, torch.where(torch.isnan(behaviour), old, behaviour)

    def _assign_advantages(
        self, prepared: Sequence[Prepared], rollouts: Sequence[RolloutScore], kl_coef: float
    ) -> dict[str, float]:
        """Every sample's advantage: its rollout's reward (less the KL penalty when
        `algorithm.use_kl_in_reward`), normalised within the rollout's group. Metrics: the
        rewards the advantages see (`critic/rewards/*`; the trainer logs the scores) and the
        advantages over trained tokens."""
        algorithm = self.config.algorithm
        metrics: dict[str, float] = {}
        rollouts = self._units(prepared, rollouts)
        scores = [r.reward for r in rollouts]
        if algorithm.use_kl_in_reward:
            kl_sums: dict[str, float] = {}
            per_sample: list[float] = []
            for p in prepared:
                assert p.ref is not None  # use_kl_in_reward builds the reference
                mask = torch.tensor(p.sample.loss_mask[1:], dtype=torch.float32)
                old = torch.nan_to_num(p.old)
                kld = kl_estimate(old, p.ref, algorithm.kl_penalty, mask=mask) * mask
                unit = self._unit_of(p.sample)
                kl_sums[unit] = kl_sums.get(unit, 0.0) + float(kld.sum())
                per_sample.append(float(kld.sum() / mask.sum().clamp(min=1)))
            scores = penalised_scores(rollouts, kl_sums, kl_coef)
            metrics["actor/reward_kl_penalty"] = sum(per_sample) / max(len(per_sample), 1)
            metrics["actor/reward_kl_penalty_coeff"] = kl_coef
        advantages = compute_advantages(
            torch.tensor(scores, dtype=torch.float32),
            [r.group_id for r in rollouts],
            algorithm.adv_estimator,
            norm_by_std=algorithm.norm_adv_by_std_in_grpo,
        ).tolist()
        by_rollout = {r.rollout_id: a for r, a in zip(rollouts, advantages)}
        for p in prepared:
            p.sample.advantage = by_rollout.get(self._unit_of(p.sample), 0.0)
        for name in self.policies:
            # The units named for this policy (`policy_unit`: the rollout id, then the policy's).
            rewards = [score for r, score in zip(rollouts, scores) if r.rollout_id.endswith(policy_unit("", name))]
            metrics[f"policy/{name}/reward_mean"] = sum(rewards) / max(len(rewards), 1)
            metrics[f"policy/{name}/n_samples"] = float(sum(p.sample.policy == name for p in prepared))
        token_advantages = [(p.sample.advantage, p.sample.num_target_tokens) for p in prepared]
        n_tokens = sum(n for _, n in token_advantages)
        metrics |= {
            "critic/rewards/mean": sum(scores) / len(scores),
            "critic/rewards/max": max(scores),
            "critic/rewards/min": min(scores),
            "critic/advantages/mean": sum(a * n for a, n in token_advantages) / max(n_tokens, 1),
            "critic/advantages/max": max(a for a, _ in token_advantages),
            "critic/advantages/min": min(a for a, _ in token_advantages),
        }
        return metrics

    def _decoupled_correction(self, prepared: Sequence[Prepared]) -> dict[str, float]:
        """The rollout correction's IS weights and rejection masks (π_old vs μ), computed once
        over the whole batch (neither changes during the update), and their metrics. Bypass
        mode has no π_old: its correction is taken per micro-batch against π_θ."""
        correction = self.config.algorithm.rollout_correction
        if self._bypass or (correction.rollout_is is None and correction.rollout_rs is None):
            return {}
        mask, old, behaviour = self._batch_tensors(prepared)
        metrics: dict[str, float] = {}
        keep = mask
        if correction.rollout_rs is not None:
            lower, upper = correction.rejection_bounds
            keep, rs_metrics = rejection_mask(
                old, behaviour, mask, correction.rollout_rs, upper, lower, correction.rollout_token_veto_threshold
            )
            metrics |= rs_metrics
            for i, p in enumerate(prepared):
                p.keep = keep[i, : len(p.sample) - 1].clone()
        if correction.rollout_is is not None:
            weights, is_metrics = importance_weights(
                old, behaviour, keep, correction.rollout_is, correction.rollout_is_threshold
            )
            if correction.rollout_is_batch_normalize:
                weights = _normalised(weights, keep)
            metrics |= is_metrics
            for i, p in enumerate(prepared):
                p.is_weights = weights[i, : len(p.sample) - 1].clone()
        return metrics

    def _assign_divisors(self, prepared: Sequence[Prepared]) -> None:
        """Agent Lightning's per_rollout_mean: each row divided by its rollout's trained tokens
        over the whole batch times the batch's rows."""
        if self.config.actor_rollout_ref.actor.policy_loss.loss_mode != "per_rollout_mean":
            return
        # Several policies: each policy's rows are a batch of their own (its steps train them).
        names: list[str | None] = [*self.policies] or [None]
        for name in names:
            rows = [p for p in prepared if name is None or p.sample.policy == name]
            tokens = [float(p.keep.sum()) if p.keep is not None else p.sample.num_target_tokens for p in rows]
            for p, divisor in zip(rows, rollout_row_divisors([self._unit_of(p.sample) for p in rows], tokens)):
                p.divisor = divisor

    def _counts(self, chunk: Sequence[Prepared]) -> BatchCounts:
        """The mini-batch's counts (every rank holds every sample, so no collective)."""
        n_tokens = n_sequences = 0.0
        for p in chunk:
            trained = p.keep if p.keep is not None else torch.tensor(p.sample.loss_mask[1:], dtype=torch.float32)
            tokens, sequences = local_counts(trained.unsqueeze(0))
            n_tokens += tokens
            n_sequences += sequences
        actor = self.config.actor_rollout_ref.actor
        return BatchCounts(n_tokens, n_sequences, actor.loss_scale_factor or float(self.config.response_budget))

    def _optimizer_step(self, chunk: list[Prepared]) -> tuple[dict[str, float], int, bool]:
        """One optimizer step on the mini-batch `chunk`, this rank taking its share by tokens:
        its metrics, its trained-token count, and whether the step was taken."""
        actor = self.config.actor_rollout_ref.actor
        if self.policies:  # the chunk is one policy's: its adapter alone gets a gradient
            lora.activate(self.model, str(chunk[0].sample.policy))
        counts = self._counts(chunk)
        mine, n_passes = rank_passes([len(p.sample) for p in chunk], self.world, self._batching())
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        shares: dict[str, float] = {}
        for position in range(n_passes):
            indices = mine[position] if position < len(mine) else []
            # A rank out of samples runs a zero-weighted pass: FSDP needs every rank's backward.
            micro = self._micro_batch([chunk[i] for i in indices] or chunk[:1], counts)
            # Each share is already divided by the whole mini-batch's counts; FSDP averages
            # gradients over the ranks, which the world size undoes.
            weight = float(self.world.size) if indices else 0.0
            (micro.loss * weight).backward()
            if indices:
                for target, values in ((sums, micro.sums), (shares, micro.shares)):
                    for key, value in values.items():
                        target[key] = target.get(key, 0.0) + value
        grad_norm = float(
            sharding.full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor.grad_clip))
        )
        # No gradient (every advantage 0: each group's rewards alike, no entropy or KL term),
        # or a broken one: no step. Adam would still move every weight along its momentum, a
        # full-size step in an old direction, and four such steps in a row collapsed a calc
        # run's policy (measured). The norm is the whole model's, so every rank decides alike.
        stepped = math.isfinite(grad_norm) and grad_norm != 0.0
        if stepped:
            self.optimizer.step()
        if self.world.distributed:
            sums, shares = _summed(sharding.all_gather_objects(sums)), _summed(sharding.all_gather_objects(shares))
        n_tokens = int(counts.n_tokens)
        result = {key: value / max(counts.n_tokens, 1.0) for key, value in sums.items()} | shares
        result["actor/grad_norm"] = grad_norm
        return result, n_tokens, stepped

    def _micro_batch(self, part: Sequence[Prepared], counts: BatchCounts) -> MicroBatchResult:
        """The loss of one forward pass (its share of the mini-batch's) and its metrics."""
        actor = self.config.actor_rollout_ref.actor
        correction = self.config.algorithm.rollout_correction
        t = {k: v.to(self.device) for k, v in collate([p.sample for p in part], self.pad_token_id).items()}
        mask = t["loss_mask"]
        width = mask.shape[1]
        fsdp = actor.fsdp_config
        logprobs, entropy = logprobs_and_entropy(
            self.model,
            t["input_ids"],
            t["attention_mask"],
            self._temperature,
            entropy_chunk_size=fsdp.entropy_chunk_size if fsdp.entropy_from_logits_with_chunking else None,
            entropy_grad=actor.entropy_coeff > 0,
            pixel_values=t.get("pixel_values"),
            image_grid_thw=t.get("image_grid_thw"),
        )
        old = pad_rows([p.old for p in part], width, device=self.device)
        behaviour = t["behaviour_logprobs"]
        is_weights: torch.Tensor | None = None
        trained = mask
        sums: dict[str, float] = {}
        if self._bypass:
            # μ serves as π_old; a call recorded without logprobs is taken as on-policy.
            old = torch.where(torch.isnan(old), logprobs.detach(), old)
            if correction.rollout_rs is not None:
                lower, upper = correction.rejection_bounds
                trained, _ = rejection_mask(
                    logprobs.detach(), old, mask, correction.rollout_rs, upper, lower,
                    correction.rollout_token_veto_threshold,
                )  # fmt: skip
                sums["rollout_corr/rollout_rs_masked_fraction"] = float(((mask > 0) & (trained == 0)).sum())
            if correction.loss_type == "reinforce" and correction.rollout_is is not None:
                is_weights, _ = importance_weights(
                    logprobs.detach(), old, trained, correction.rollout_is, correction.rollout_is_threshold
                )
            sums["rollout_corr/kl"] = float(torch.where(mask > 0, old - logprobs.detach(), 0.0).sum())
        else:
            if part[0].keep is not None:
                trained = pad_rows([p.keep for p in part if p.keep is not None], width, device=self.device)
            if part[0].is_weights is not None:
                is_weights = pad_rows(
                    [p.is_weights for p in part if p.is_weights is not None], width, device=self.device
                )
            behaviour = torch.where(torch.isnan(behaviour), old, behaviour)
            sums["actor/behaviour_mismatch_abs"] = float(torch.where(trained > 0, (behaviour - old).abs(), 0.0).sum())
        terms = POLICY_LOSSES[correction.loss_type](
            PolicyLossInputs(logprobs, old, t["advantages"], trained, is_weights),
            ClipRange(actor.clip_low, actor.clip_high, actor.clip_ratio_c),
        )
        if actor.policy_loss.loss_mode == "per_rollout_mean":
            pg_loss = per_rollout_mean(terms.per_token, trained, [p.divisor for p in part])
        else:
            pg_loss = aggregate(terms.per_token, trained, actor.loss_agg_mode, counts)
        loss = pg_loss
        shares = {"actor/pg_loss": float(pg_loss.detach())}
        if actor.entropy_coeff > 0:
            loss = loss - actor.entropy_coeff * aggregate(entropy, trained, actor.loss_agg_mode, counts)
        if actor.use_kl_loss:
            ref = pad_rows([p.ref for p in part if p.ref is not None], width, device=self.device)
            kl = aggregate(
                kl_estimate(logprobs, ref, actor.kl_loss_type, mask=trained), trained, actor.loss_agg_mode, counts
            )
            loss = loss + actor.kl_loss_coef * kl
            shares["actor/kl_loss"] = float(kl.detach())
        on = trained > 0
        sums |= {
            "actor/pg_clipfrac": float(terms.clipped.sum()),
            "actor/pg_clipfrac_lower": float(terms.dual_clipped.sum()),
            "actor/ppo_kl": float(torch.where(on, -terms.log_ratio, 0.0).sum()),
            "actor/entropy": float(torch.where(on, entropy.detach(), 0.0).sum()),
        }
        return MicroBatchResult(loss, sums, shares)


def _normalised(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's `rollout_is_batch_normalize`: the truncated weights rescaled to mean 1 over the
    batch's trained tokens."""
    valid = mask > 0
    mean = weights[valid].mean() if bool(valid.any()) else torch.tensor(1.0)
    return torch.where(valid, weights / mean.clamp(min=1e-8), torch.zeros_like(weights))


def _summed(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total
