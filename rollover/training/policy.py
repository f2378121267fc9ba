"""The trainable policy and one PPO update (SPEC §5) over samples from complete groups.

On several ranks (`World.distributed`) the model is sharded with FSDP2 and every rank runs
`run_update` on the same `UpdatePlan`: π_old is computed on each rank for its share and
gathered, each optimizer step's samples are split across ranks by token count, and the
token-mean's denominator is the mini-batch's global count, so N ranks take the step one
rank would.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rollover.config import RolloverConfig
from rollover.distributed import sharding
from rollover.distributed.split import balanced_split
from rollover.distributed.world import World
from rollover.metrics.progress import NullProgress, Progress
from rollover.training.algorithms import ppo_policy_loss, rollout_correction_weights
from rollover.training.logprobs import token_logprobs
from rollover.training.samples import Sample, collate

Prepared = tuple[Sample, dict[str, torch.Tensor]]


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


@dataclass
class UpdatePlan:
    """One update, decided on rank 0: the samples and, per optimizer step, the indices of its
    mini-batch (the shuffles of every PPO epoch)."""

    samples: list[Sample]
    steps: list[list[int]]


class Policy:
    """A causal LM with its tokenizer and optimizer, on this rank's device (sharded over the
    ranks when there are several)."""

    progress: Progress = NullProgress()  # told of each optimizer step (from the update's thread)
    world: World = World()  # one rank unless given

    def __init__(self, model_path: str | Path, config: RolloverConfig, world: World | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.world = world or World()
        self.device = self.world.device(config.trainer.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)  # type: ignore[arg-type]
        model.config.use_cache = False
        if config.actor_rollout_ref.model.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.world.distributed:
            fsdp = config.actor_rollout_ref.actor.fsdp_config
            mixed = fsdp.mixed_precision == "bf16" or (fsdp.mixed_precision == "auto" and self.device.type == "cuda")
            model = sharding.shard_model(
                model, mixed_precision=mixed, offload=fsdp.param_offload or fsdp.optimizer_offload
            )
        self.model = model
        optim = config.actor_rollout_ref.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    # -- weights and checkpoints (collectives on several ranks) ----------------------------

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]:
        return sharding.full_state_dict(self.model, keep=keep)

    def save(self, directory: str | Path) -> Path:
        """The model as a Hugging Face folder (weights, config, tokenizer), written by rank 0."""
        directory = Path(directory)
        if not self.world.distributed:
            self.model.save_pretrained(directory, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
            return directory
        weights = self.full_state_dict(keep=self.world.is_leader)
        if self.world.is_leader:
            from safetensors.torch import save_file

            directory.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
        return directory

    def save_training_state(self, directory: str | Path) -> None:
        """Model and optimizer, sharded (`torch.distributed.checkpoint`), loadable on any
        number of ranks."""
        sharding.save_training_state(self.model, self.optimizer, Path(directory))

    def load_training_state(self, directory: str | Path) -> None:
        sharding.load_training_state(self.model, self.optimizer, Path(directory))

    # -- the update -----------------------------------------------------------------------

    def plan(self, samples: Sequence[Sample], rng: random.Random) -> UpdatePlan:
        """The samples with targets and each optimizer step's mini-batch; `rng` shuffles each
        PPO epoch (it is the trainer's, checkpointed)."""
        kept = [s for s in samples if s.num_target_tokens > 0]
        mini = self._mini_batch_samples(len(kept))
        steps: list[list[int]] = []
        for _ in range(self.config.actor_rollout_ref.actor.ppo_epochs):
            order = list(range(len(kept)))
            rng.shuffle(order)
            steps += [order[start : start + mini] for start in range(0, len(order), mini)]
        return UpdatePlan(kept, steps)

    def update(self, samples: Sequence[Sample], rng: random.Random) -> dict[str, float]:
        """PPO epochs over the samples on this rank alone (see `run_update`)."""
        return self.run_update(self.plan(samples, rng))

    def run_update(self, plan: UpdatePlan) -> dict[str, float]:
        """The plan's optimizer steps, on every rank at once; returns token-weighted metrics
        (the rollout correction's are the whole batch's), the same on every rank."""
        if not plan.samples:
            return {}
        correction = self.config.algorithm.rollout_correction
        # vLLM records processed logprobs (after temperature: the distribution it sampled
        # from, see VLLMEngine's logprobs_mode), so π is computed at the same temperature.
        temperature = self.config.actor_rollout_ref.rollout.temperature or 1.0

        # π_old: the trainer's logprobs before this update, recomputed once, each rank its share.
        prepared = self._with_old_logprobs(plan.samples, temperature)
        corr_metrics = self._attach_is_weights(prepared, correction.rollout_is, correction.rollout_is_threshold)

        sums: dict[str, float] = {}
        total_tokens = 0
        self.progress.update(0, len(plan.steps))
        skipped = 0
        for done, indices in enumerate(plan.steps, start=1):
            metrics, tokens, stepped = self._optimizer_step([prepared[i] for i in indices], temperature)
            skipped += not stepped
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * tokens
            total_tokens += tokens
            self.progress.update(done, len(plan.steps))
        averaged = {key: value / max(total_tokens, 1) for key, value in sums.items()}
        # A count of optimizer steps left out for want of a gradient, not a token mean.
        return averaged | {"actor/n_skipped_steps": float(skipped)} | corr_metrics

    def _my_share(self, samples: Sequence[Sample]) -> tuple[list[int], int]:
        """This rank's indices of `samples` and the number of micro-batches every rank runs
        (the most any rank needs: FSDP's collectives need the same count on each)."""
        size = self.config.actor_rollout_ref.actor.ppo_micro_batch_size
        parts = balanced_split([len(s) for s in samples], self.world.size)
        return parts[self.world.rank], max(math.ceil(len(part) / size) for part in parts)

    def _mini_batch_samples(self, n_samples: int) -> int:
        """Samples per optimizer step: `ppo_mini_batch_size` counts prompts, as in verl, each
        with `rollout.n` samples (the whole batch when null)."""
        config = self.config.actor_rollout_ref
        prompts = config.actor.ppo_mini_batch_size
        return n_samples if prompts is None else prompts * config.rollout.n

    def _attach_is_weights(
        self,
        prepared: list[tuple[Sample, dict[str, torch.Tensor]]],
        rollout_is: Literal["token", "sequence"] | None,
        threshold: float,
    ) -> dict[str, float]:
        """The rollout-correction weights of every sample, computed once over the whole batch
        (π_old and μ do not change during the update), and their metrics, the batch's."""
        if rollout_is is None:
            return {}
        batch = collate([sample for sample, _ in prepared], self.pad_token_id)
        mask = batch["loss_mask"]
        old = torch.zeros_like(mask)
        for i, (_, extra) in enumerate(prepared):
            old[i, : extra["old_logprobs"].shape[0]] = extra["old_logprobs"].float().cpu()
        # Calls recorded without logprobs get μ = π_old (weight 1) rather than NaN.
        behaviour = torch.where(torch.isnan(batch["behaviour_logprobs"]), old, batch["behaviour_logprobs"])
        weights, metrics = rollout_correction_weights(old, behaviour, mask, rollout_is, threshold)
        assert weights is not None  # rollout_is is set
        for i, (sample, extra) in enumerate(prepared):
            extra["is_weights"] = weights[i, : len(sample) - 1].to(self.device)
        return metrics

    def _with_old_logprobs(self, samples: Sequence[Sample], temperature: float) -> list[Prepared]:
        """Per-sample tensors (unpadded, on the host) with π_old attached: each rank computes
        its share in micro-batches, then every rank gets every sample's."""
        mine, n_micro = self._my_share(samples)
        size = self.config.actor_rollout_ref.actor.ppo_micro_batch_size
        computed: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            self.model.eval()
            for start in range(0, n_micro * size, size):
                indices = mine[start : start + size]
                # A rank out of samples still runs the forward (on a stand-in) for FSDP's gathers.
                chunk = [samples[i] for i in indices] or [samples[0]]
                t = {k: v.to(self.device) for k, v in collate(chunk, self.pad_token_id).items()}
                old = token_logprobs(self.model, t["input_ids"], t["attention_mask"], temperature=temperature)
                for row, index in enumerate(indices):
                    computed[index] = old[row, : len(samples[index]) - 1].detach().cpu()
            self.model.train()
        for part in sharding.all_gather_objects(computed) if self.world.distributed else [computed]:
            computed.update(part)
        return [(sample, {"old_logprobs": computed[i].to(self.device)}) for i, sample in enumerate(samples)]

    def _optimizer_step(self, chunk: list[Prepared], temperature: float) -> tuple[dict[str, float], int, bool]:
        """One optimizer step on the mini-batch `chunk`, this rank taking its share by tokens:
        its metrics, its loss-token count, and whether the step was taken."""
        actor = self.config.actor_rollout_ref.actor
        size = actor.ppo_micro_batch_size
        parts = balanced_split([len(sample) for sample, _ in chunk], self.world.size)
        mine = [chunk[i] for i in parts[self.world.rank]]
        n_micro = max(math.ceil(len(part) / size) for part in parts)
        # The token-mean's count is the whole mini-batch's, over all ranks, of the
        # target-aligned mask the loss sums over.
        n_tokens = sharding.all_reduce_sum(sum(sample.num_target_tokens for sample, _ in mine), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for start in range(0, n_micro * size, size):
            part = mine[start : start + size]
            # A rank out of samples runs a zero-weighted pass: FSDP needs every rank's backward.
            stand_in = not part
            part = part or chunk[:1]
            loss, metrics, part_tokens = self._micro_batch_loss(part, temperature)
            # Token-mean over the whole mini-batch; FSDP averages gradients over the ranks,
            # which the world size undoes.
            weight = 0.0 if stand_in else part_tokens * self.world.size / max(n_tokens, 1)
            (loss * weight).backward()
            if not stand_in:
                for key, value in metrics.items():
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        sums[key] = sums.get(key, 0.0) + float(value) * part_tokens
        grad_norm = float(
            sharding.full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor.grad_clip))
        )
        # No gradient (every advantage 0: each group's rewards alike), or a broken one: no step.
        # Adam would still move every weight along its momentum, a full-size step in an old
        # direction, and four such steps in a row collapsed a calc run's policy (measured).
        # The norm is the whole model's, so every rank decides alike.
        stepped = math.isfinite(grad_norm) and grad_norm != 0.0
        if stepped:
            self.optimizer.step()
        if self.world.distributed:
            totals: dict[str, float] = {}
            for rank_sums in sharding.all_gather_objects(sums):
                for key, value in rank_sums.items():
                    totals[key] = totals.get(key, 0.0) + value
            sums = totals
        result = {key: value / max(n_tokens, 1) for key, value in sums.items()}
        result["actor/grad_norm"] = grad_norm
        result["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        return result, n_tokens, stepped

    def _micro_batch_loss(self, part: list[Prepared], temperature: float) -> tuple[torch.Tensor, dict[str, float], int]:
        """The PPO loss (token-mean over `part`), its metrics and its count of loss tokens."""
        actor = self.config.actor_rollout_ref.actor
        t = {k: v.to(self.device) for k, v in collate([s for s, _ in part], self.pad_token_id).items()}
        width = t["loss_mask"].shape[1]
        old = torch.zeros_like(t["loss_mask"], dtype=torch.float32)
        weights = torch.zeros_like(old) if "is_weights" in part[0][1] else None
        for i, (_, extra) in enumerate(part):
            old[i, : extra["old_logprobs"].shape[0]] = extra["old_logprobs"][:width]
            if weights is not None:
                weights[i, : extra["is_weights"].shape[0]] = extra["is_weights"][:width]
        mask = t["loss_mask"]
        behaviour = torch.where(torch.isnan(t["behaviour_logprobs"]), old, t["behaviour_logprobs"])
        logprobs = token_logprobs(self.model, t["input_ids"], t["attention_mask"], temperature=temperature)
        loss, metrics = ppo_policy_loss(
            logprobs,
            old,
            t["advantages"],
            mask,
            clip_ratio=actor.clip_ratio,
            clip_ratio_c=actor.clip_ratio_c,
            is_weights=weights,
        )
        part_tokens = int(mask.sum().item())
        mismatch = ((behaviour - old) * mask).abs().sum().item() / max(part_tokens, 1)
        return loss, {**metrics, "actor/behaviour_mismatch_abs": mismatch}, part_tokens
