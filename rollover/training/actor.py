"""The actor: the trained causal LM (or vision-language model) with its tokenizer and optimizer (sharded over the ranks when
there are several), its checkpoints, and the optimizer steps of one update.

One update, from `Trainer.train_step` to `optimizer.step()`:

1. `plan.plan_update` (rank 0): the samples and each optimizer step's mini-batch;
2. `Actor.run_update` (every rank, the same plan): `forward.recompute` (π_old, each sample
   through its own policy's adapter; π_ref; Σπ²), then `prepare.prepare_update`: rollout
   correction, advantages, per_rollout_mean's divisors, over the whole batch;
3. `Actor._optimizer_step` per mini-batch: this rank's share of its micro-batches, each
   `objective.micro_batch_objective` over the mini-batch's counts, backward, then one
   `optimizer.step()`; so N ranks and any micro-batching take the step one rank with the whole
   mini-batch would.

With several policies (`agentlightning.policies`, each a LoRA adapter) each optimizer step
trains one policy's mini-batch at that policy's learning rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from rollover.distributed import sharding
from rollover.distributed.world import World
from rollover.metrics.progress import NullProgress, Progress
from rollover.training import lora
from rollover.training.forward import packed_pass, rank_passes, recompute
from rollover.training.logprobs import logprobs_and_entropy, packed_logprobs
from rollover.training.loss.aggregate import mini_batch_counts
from rollover.training.loss.covariance import mini_batch_selection
from rollover.training.objective import Forward, MetricTotals, micro_batch_objective
from rollover.training.packing import PassTokens
from rollover.training.plan import UpdatePlan, plan_update
from rollover.training.prepare import PreparedSample, Recomputed, prepare_update
from rollover.training.reference import AdapterOffReference, Reference
from rollover.training.samples import Sample, UpdateBatch, collate, pad_rows
from rollover.training.update_settings import ActorSettings
from rollover.vision.model import auto_model_class, copy_processor, freeze_vision_tower


class Actor:
    """The trained model (see the module's docstring). Build it from a model folder with
    `Actor.load`, or around a model already in memory."""

    progress: Progress = NullProgress()  # told of each optimizer step (from the update's thread)

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        settings: ActorSettings,
        world: World | None = None,
        *,
        reference: Reference | AdapterOffReference | None = None,
        device: torch.device | None = None,
        model_path: str | Path | None = None,
    ) -> None:
        self.model = model
        self.model_path = None if model_path is None else Path(model_path)  # its image processor's folder
        self.tokenizer = tokenizer
        self.settings = settings
        self.world = world or World()
        self.device = device or torch.device("cpu")
        self.reference = reference
        self._tokens = PassTokens()  # the current update's forward passes' tokens (this rank's)
        self._adapter_names = lora.SavedNames()  # PEFT's names of the adapters, learnt at the first save
        policies, optimizer = settings.policies, settings.optimizer
        # With LoRA only the adapter is trainable: the base has no gradients and no Adam state.
        # Several policies: a parameter group per policy's adapter, its lr a multiple of the
        # actor's (so the lr schedule scales every policy's alike).
        groups = (
            [{"params": lora.adapter_parameters(model, name)} for name in policies]
            if policies
            else [{"params": [p for p in model.parameters() if p.requires_grad]}]
        )
        self.optimizer = torch.optim.AdamW(
            groups, lr=optimizer.lr, weight_decay=optimizer.weight_decay, betas=optimizer.betas
        )
        for group, scale in zip(self.optimizer.param_groups, optimizer.lr_scales):
            group["lr"] = optimizer.lr * scale
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)

    @classmethod
    def load(cls, model_path: str | Path, settings: ActorSettings, world: World | None = None) -> Actor:
        """The model in `model_path` (with LoRA: wrapped in its adapter; on several ranks:
        sharded), and the frozen reference when a KL term needs it: the model this run starts
        from (a resumed run's base, not its checkpoint: launch loads the checkpoint's weights
        after), or with LoRA the same model with its adapter disabled. A vision-language model
        loads as an image-text-to-text model; LoRA adapts its language model only."""
        from transformers import AutoTokenizer

        world = world or World()
        device = world.device(settings.device)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = auto_model_class(model_path).from_pretrained(model_path, dtype=torch.float32).to(device)
        model.config.use_cache = False
        if settings.freeze_vision_tower:
            freeze_vision_tower(model)
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if settings.lora is not None:  # before sharding: FSDP2 shards the adapter with its layer
            model = lora.wrap(model, settings.lora, model_path, seed=settings.seed, policies=settings.policies)
        if world.distributed:
            model = sharding.shard_model(
                model, mixed_precision=settings.sharding.bf16(device.type), offload=settings.sharding.offload
            )
        reference: Reference | AdapterOffReference | None = None
        if settings.reference is not None:
            reference = (
                AdapterOffReference(model, settings.reference, world, device)
                if settings.lora is not None
                else Reference(model_path, settings.reference, world, device)
            )
        return cls(model, tokenizer, settings, world, reference=reference, device=device, model_path=model_path)

    # -- weights and checkpoints (collectives on several ranks) ----------------------------

    @property
    def lora(self) -> bool:
        return self.settings.lora is not None

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]:
        """The whole model's weights, gathered (a collective on several ranks), under the names
        its checkpoint uses: what `save_pretrained` writes and what vLLM loads. transformers 5
        renames some models' weights at load (Qwen2-VL's `model.layers.*` are
        `model.language_model.layers.*` in memory, `visual.*` is `model.visual.*`), and vLLM
        0.32 reloaded the in-memory names into the wrong places: the vision calc example's
        policy wrote garbage after its first update."""
        weights = sharding.full_state_dict(self.model, keep=keep)
        return checkpoint_names(self.model, weights) if keep else weights

    def save_adapter(self, directory: str | Path, *, write: bool) -> None:
        """LoRA: the adapter alone, gathered (a collective on several ranks), as a PEFT folder
        written by the ranks with `write`."""
        if not self.settings.policies:
            state = lora.adapter_state_dict(self.model, keep=write, names=self._adapter_names)
            if write:
                lora.write_adapter(state, self.model, directory)
            return
        for name in self.settings.policies:  # the same order on every rank: each is a collective
            state = lora.adapter_state_dict(self.model, keep=write, name=name, names=self._adapter_names)
            if write:
                lora.write_adapter(state, self.model, Path(directory) / name, name)

    def save(self, directory: str | Path) -> Path:
        """The model as a Hugging Face folder (weights, config, tokenizer), written by rank 0;
        with LoRA the adapter as a PEFT folder (with the tokenizer) instead: the base never
        changes (`rollover model merge` makes one model of the two). A vision model's folder keeps
        its image processor's settings, so a resumed run reads images as before."""
        directory = Path(directory)
        if self.lora:
            self.save_adapter(directory, write=self.world.is_leader)
            if self.world.is_leader:
                self.tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
                self._copy_processor(directory)
            return directory
        if not self.world.distributed:
            self.model.save_pretrained(directory, safe_serialization=True)  # type: ignore[operator]
            self.tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
            self._copy_processor(directory)
            return directory
        weights = self.full_state_dict(keep=self.world.is_leader)
        if self.world.is_leader:
            from safetensors.torch import save_file

            directory.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(directory)  # type: ignore[union-attr, operator]
            self.tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
            self._copy_processor(directory)
        return directory

    def _copy_processor(self, directory: Path) -> None:
        if self.model_path is not None:
            copy_processor(self.model_path, directory)

    def save_training_state(self, directory: str | Path) -> None:
        """Model and optimizer, sharded (`torch.distributed.checkpoint`), loadable on any
        number of ranks; with LoRA the adapter and its optimizer state only."""
        sharding.save_training_state(self.model, self.optimizer, Path(directory), trainable_only=self.lora)

    def load_training_state(self, directory: str | Path) -> None:
        sharding.load_training_state(self.model, self.optimizer, Path(directory), trainable_only=self.lora)

    # -- the update -----------------------------------------------------------------------

    def plan(self, batch: UpdateBatch, rng: random.Random, *, lr: float, kl_coef: float = 0.0) -> UpdatePlan:
        """Rank 0's plan of an update (`plan.plan_update`)."""
        return plan_update(batch, self.settings.plan, rng, lr=lr, kl_coef=kl_coef)

    def update(self, batch: UpdateBatch, rng: random.Random, *, lr: float, kl_coef: float = 0.0) -> dict[str, float]:
        """One update on this rank alone (see `run_update`)."""
        return self.run_update(self.plan(batch, rng, lr=lr, kl_coef=kl_coef))

    def run_update(self, plan: UpdatePlan) -> dict[str, float]:
        """The plan's optimizer steps, on every rank at once; returns token-weighted metrics
        (the rollout correction's and the advantages' are the whole batch's), the same on
        every rank."""
        if not plan.samples:
            return {}
        for group, scale in zip(self.optimizer.param_groups, self.settings.optimizer.lr_scales):
            group["lr"] = plan.lr * scale
        self._tokens = PassTokens()
        prepared = prepare_update(
            plan.samples,
            plan.rollouts,
            self.recompute(plan.samples),
            self.settings.update,
            kl_coef=plan.kl_coef,
            policies=self.settings.policies,
        )
        # Token-weighted over every step, and with several policies over each policy's steps.
        sums: dict[str, dict[str, float]] = {}
        tokens_by: dict[str, float] = {}
        self.progress.update(0, len(plan.steps))
        skipped = 0
        for done, indices in enumerate(plan.steps, start=1):
            rows = [prepared.rows[i] for i in indices]
            step_metrics, tokens, stepped = self._optimizer_step(rows, plan.seed + done)
            skipped += not stepped
            for prefix in [""] + ([f"policy/{rows[0].sample.policy}/"] if self.settings.policies else []):
                into = sums.setdefault(prefix, {})
                for key, value in step_metrics.items():
                    into[key] = into.get(key, 0.0) + value * tokens
                tokens_by[prefix] = tokens_by.get(prefix, 0.0) + tokens
            self.progress.update(done, len(plan.steps))
        averaged = {
            prefix + key: value / max(tokens_by[prefix], 1.0)
            for prefix, into in sums.items()
            for key, value in into.items()
        }
        # Settings are reported as set, not through the token mean (float sums move a
        # constant in its last bits); skipped steps are a count.
        settings = {"actor/lr": plan.lr, "actor/n_skipped_steps": float(skipped)}
        if self.settings.update.kl_loss_coef is not None:
            settings["actor/kl_coef"] = self.settings.update.kl_loss_coef
        passes = self._tokens
        if self.world.distributed:  # every rank's passes
            passes = PassTokens()
            for part in sharding.all_gather_objects(self._tokens):
                passes.merge(part)
        return averaged | settings | plan.metrics | prepared.metrics | passes.metrics()

    def recompute(self, samples: Sequence[Sample]) -> list[Recomputed]:
        """π_old (in bypass mode the recorded μ), Σπ² and π_ref of every sample (`forward.recompute`)."""
        return recompute(
            self.model,
            samples,
            self.settings,
            self.reference,
            pad_token_id=self.pad_token_id,
            world=self.world,
            device=self.device,
            tokens=self._tokens,
        )

    # -- one optimizer step ---------------------------------------------------------------

    def _forward(self, rows: Sequence[PreparedSample], count: bool = True) -> Forward:
        """One pass with gradient over `rows`: padded, or packed into one row (`packing`)."""
        update = self.settings.update
        samples = [r.sample for r in rows]
        packed = packed_pass(self.model, samples, self.settings.micro_batches)
        if packed is not None:
            if count:
                self._tokens.add_packed(packed)
            logprobs, entropy, _ = packed_logprobs(
                self.model,
                packed.to(self.device),
                update.temperature,
                entropy=True,
                entropy_chunk_size=update.entropy_chunk_size,
                entropy_grad=update.entropy_coeff > 0,
            )
            assert entropy is not None
            return Forward(logprobs, entropy)
        if count:
            self._tokens.add_padded([len(s) for s in samples])
        batch = {k: v.to(self.device) for k, v in collate(samples, self.pad_token_id).items()}
        logprobs, entropy = logprobs_and_entropy(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            update.temperature,
            entropy_chunk_size=update.entropy_chunk_size,
            entropy_grad=update.entropy_coeff > 0,
            pixel_values=batch.get("pixel_values"),  # a vision model's images, in row order
            image_grid_thw=batch.get("image_grid_thw"),
        )
        return Forward(logprobs, entropy)

    def _optimizer_step(self, rows: list[PreparedSample], seed: int) -> tuple[dict[str, float], float, bool]:
        """One optimizer step on the mini-batch `rows`, this rank taking its share by tokens:
        its metrics, its trained-token count, and whether the step was taken."""
        if self.settings.policies:  # the mini-batch is one policy's: its adapter alone gets a gradient
            lora.activate(self.model, str(rows[0].sample.policy))
        # The mini-batch's counts (every rank holds every sample: no collective).
        counts = mini_batch_counts([r.trained for r in rows], self.settings.update.norm_length)
        selection = mini_batch_selection(
            [r.advantages for r in rows], [r.old for r in rows], [r.trained for r in rows], self.settings.update, seed
        )
        mine, n_passes = rank_passes(
            [len(r.sample) for r in rows], self.world, self.settings.micro_batches, [r.sample.input_ids for r in rows]
        )
        self.optimizer.zero_grad(set_to_none=True)
        totals = MetricTotals()
        for position in range(n_passes):
            indices = mine[position] if position < len(mine) else []
            # A rank out of samples runs a zero-weighted pass: FSDP needs every rank's backward.
            part = [rows[i] for i in indices] or rows[:1]
            forward = self._forward(part, count=bool(indices))
            selected = None
            if selection is not None:
                chosen = [selection[i] for i in indices] or selection[:1]
                selected = pad_rows(chosen, forward.logprobs.shape[1], device=self.device)
            micro = micro_batch_objective(forward, part, counts, self.settings.update, selected)
            # Each share is already divided by the whole mini-batch's counts; FSDP averages
            # gradients over the ranks, which the world size undoes.
            weight = float(self.world.size) if indices else 0.0
            (micro.loss * weight).backward()
            if indices:
                totals.add(micro)
        grad_norm = float(
            sharding.full_tensor(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.update.grad_clip)
            )
        )
        # No gradient (every advantage 0: each group's rewards alike, no entropy or KL term),
        # or a broken one: no step. Adam would still move every weight along its momentum, a
        # full-size step in an old direction, and four such steps in a row collapsed a calc
        # run's policy (measured). The norm is the whole model's, so every rank decides alike.
        stepped = math.isfinite(grad_norm) and grad_norm != 0.0
        if stepped:
            self.optimizer.step()
        if self.world.distributed:
            totals = MetricTotals.merged(sharding.all_gather_objects(totals))
        result = totals.values()
        result["actor/grad_norm"] = grad_norm
        return result, counts.n_tokens, stepped


def checkpoint_names(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (the model's own names) under its checkpoint's names, by transformers' own
    reversal of the renaming it applied at load (what `save_pretrained` does); unchanged for
    a model transformers does not rename, and for a PEFT-wrapped one."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(model, PreTrainedModel):
        return weights
    return dict(revert_weight_conversion(model, weights))
