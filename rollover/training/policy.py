"""The trainable policy and one PPO update (SPEC §5) over samples from complete groups."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from rollover.config import RolloverConfig
from rollover.metrics.progress import NullProgress, Progress
from rollover.training.algorithms import ppo_policy_loss, rollout_correction_weights
from rollover.training.logprobs import token_logprobs
from rollover.training.samples import Sample, collate


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


class Policy:
    """A causal LM with its tokenizer and optimizer, on the trainer's device."""

    progress: Progress = NullProgress()  # told of each optimizer step (from the update's thread)

    def __init__(self, model_path: str | Path, config: RolloverConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.device = pick_device(config.trainer.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)  # type: ignore[arg-type]
        self.model.config.use_cache = False
        optim = config.actor_rollout_ref.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
        return directory

    def update(self, samples: Sequence[Sample], rng: random.Random) -> dict[str, float]:
        """PPO epochs over the samples; returns token-weighted metrics (the rollout
        correction's are the whole batch's)."""
        samples = [s for s in samples if s.num_target_tokens > 0]
        if not samples:
            return {}
        actor = self.config.actor_rollout_ref.actor
        correction = self.config.algorithm.rollout_correction
        # vLLM records processed logprobs (after temperature: the distribution it sampled
        # from, see VLLMEngine's logprobs_mode), so π is computed at the same temperature.
        temperature = self.config.actor_rollout_ref.rollout.temperature or 1.0

        # π_old: the trainer's logprobs before this update, recomputed once.
        prepared = [row for rows in self._with_old_logprobs(samples, temperature) for row in rows]
        corr_metrics = self._attach_is_weights(prepared, correction.rollout_is, correction.rollout_is_threshold)

        sums: dict[str, float] = {}
        total_tokens = 0
        mini = self._mini_batch_samples(len(prepared))
        n_steps, done = actor.ppo_epochs * math.ceil(len(prepared) / mini), 0
        self.progress.update(done, n_steps)
        for _ in range(actor.ppo_epochs):
            order = list(range(len(prepared)))
            rng.shuffle(order)
            for start in range(0, len(order), mini):
                chunk = [prepared[i] for i in order[start : start + mini]]
                metrics, tokens = self._optimizer_step(chunk, temperature)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value * tokens
                total_tokens += tokens
                done += 1
                self.progress.update(done, n_steps)
        return {key: value / max(total_tokens, 1) for key, value in sums.items()} | corr_metrics

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

    def _with_old_logprobs(
        self, samples: Sequence[Sample], temperature: float
    ) -> list[list[tuple[Sample, dict[str, torch.Tensor]]]]:
        """Per-sample tensors (unpadded) with π_old attached, computed in micro-batches."""
        out = []
        size = self.config.actor_rollout_ref.actor.ppo_micro_batch_size
        with torch.no_grad():
            self.model.eval()
            for start in range(0, len(samples), size):
                chunk = samples[start : start + size]
                t = {k: v.to(self.device) for k, v in collate(chunk, self.pad_token_id).items()}
                old = token_logprobs(self.model, t["input_ids"], t["attention_mask"], temperature=temperature)
                rows = []
                for i, sample in enumerate(chunk):
                    length = len(sample) - 1
                    rows.append((sample, {"old_logprobs": old[i, :length].detach()}))
                out.append(rows)
            self.model.train()
        return out

    def _optimizer_step(
        self, chunk: list[tuple[Sample, dict[str, torch.Tensor]]], temperature: float
    ) -> tuple[dict[str, float], int]:
        actor = self.config.actor_rollout_ref.actor
        size = actor.ppo_micro_batch_size
        # The token-mean's count is of the target-aligned mask the loss sums over.
        n_tokens = sum(sample.num_target_tokens for sample, _ in chunk)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for start in range(0, len(chunk), size):
            part = chunk[start : start + size]
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
            # Token-mean over the whole mini-batch, accumulated across micro-batches.
            (loss * (part_tokens / max(n_tokens, 1))).backward()
            mismatch = ((behaviour - old) * mask).abs().sum().item() / max(part_tokens, 1)
            metrics = {**metrics, "actor/behaviour_mismatch_abs": mismatch}
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    sums[key] = sums.get(key, 0.0) + float(value) * part_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor.grad_clip)
        self.optimizer.step()
        result = {key: value / max(n_tokens, 1) for key, value in sums.items()}
        result["actor/grad_norm"] = float(grad_norm)
        result["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        return result, n_tokens
