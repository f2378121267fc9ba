"""The training loop: window top-up → rollout → pause/drain → update → weight sync (SPEC §4).

Its rooms: the window of groups (`manager`), the gateway around an update (`drain`), a step's
samples (`collect`), the update itself (`Actor.update`, see `actor`), checkpoints
(`checkpoint`); its settings are `settings.TrainerSettings`, built once from the config.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollover.gateway.client import GatewayClient
from rollover.metrics import MetricsLogger, summarize
from rollover.metrics.progress import NullProgress, Progress
from rollover.store.models import ProxyState, RolloutState
from rollover.training.checkpoint import save_checkpoint
from rollover.training.collect import collect_samples, rollout_reward
from rollover.training.data import PromptLoader
from rollover.training.drain import DrainTimeout, GatewayPause
from rollover.training.images import SampleImages
from rollover.training.loss.kl import adaptive_kl_coef
from rollover.training.manager import (
    AsyncRolloutManager,
    GatewayBackend,
    GroupedResult,
    GroupFilter,
    Prompt,
    RolloutBackend,
    TrackedRollout,
    group_by_data_id,
)
from rollover.training.partial import oldest_token_version, spanning_metrics
from rollover.training.samples import UpdateBatch
from rollover.training.schedule import lr_factor, warmup_steps
from rollover.training.settings import TrainerSettings

__all__ = ["DrainTimeout", "RolloutsFailing", "Trainer"]

log = logging.getLogger("rollover.trainer")


class RolloutsFailing(RuntimeError):
    """Every rollout of `trainer.max_failed_steps` steps in a row failed: the agents, not
    chance, are broken (a bad agent class, a missing dependency), and more steps would only
    spend time on updates that never come."""


class WeightSync(Protocol):
    """Moves the trainer's weights into the inference engine (collocated on one device)."""

    async def before_update(self) -> None: ...

    async def sync(self, actor: Any, version: int) -> None: ...


class ActorLike(Protocol):
    """The trained model as the loop sees it (`actor.Actor`, or rank 0's `LeaderActor`)."""

    tokenizer: Any

    def update(
        self, batch: UpdateBatch, rng: random.Random, *, lr: float, kl_coef: float = 0.0
    ) -> dict[str, float]: ...

    def save(self, directory: str | Path) -> Path: ...

    def save_training_state(self, directory: str | Path) -> None: ...


@dataclass
class Trainer:
    settings: TrainerSettings
    client: GatewayClient
    actor: ActorLike
    weight_sync: WeightSync
    train_tasks: list[dict[str, Any]]
    val_tasks: list[dict[str, Any]] = field(default_factory=list)
    metrics: MetricsLogger | None = None
    backend: RolloutBackend | None = None
    run_dir: Path | None = None
    poll_interval: float = 0.2
    clock: Callable[[], float] = time.monotonic  # `rollover simulate` drives the trainer in virtual time
    progress: Progress = field(default_factory=NullProgress)  # live display of the running step
    world_size: int = 1  # trainer ranks taking part in each update
    images: SampleImages | None = None  # a vision-language model's: the samples' pixel inputs

    def __post_init__(self) -> None:
        settings = self.settings
        rollout_config = {"timeout_seconds": settings.rollout_timeout_seconds}
        self._backend: RolloutBackend = self.backend or GatewayBackend(self.client, rollout_config, self.poll_interval)
        self.backend = self._backend
        self.manager = AsyncRolloutManager(
            self._backend,
            settings.rollout_n,
            on_poll=lambda window: self.progress.rollout_wait(window),
            group_filter=self._group_filter(),
        )
        self.loader = PromptLoader(self.train_tasks, seed=settings.data_seed)
        self.kl_coef = settings.kl_in_reward.initial_coef  # KL in the reward; adaptive: moves
        self._bundles: dict[str, Any] = {}  # triplet bundles the group filter fetched, by rollout id
        self.rng = random.Random(settings.seed)
        self._carry_over_rollouts: list[TrackedRollout] = []
        self._failed_steps = 0  # steps in a row whose every completed rollout failed
        self.global_step = 0
        self.policy_version = 0
        self.history: list[dict[str, float]] = []
        self.gateway = GatewayPause(
            self.client,
            partial_rollout=settings.partial_rollout,
            retry_after_seconds=settings.retry_after_seconds,
            drain_timeout_seconds=settings.drain_timeout_seconds,
            clock=self.clock,
        )

    # -- the window -----------------------------------------------------------------------

    def _next_train_batch_dict_for_rollout(self) -> list[Prompt]:
        """New prompts that top the active window back up to `async_train_batch_size` groups."""
        n_carry_over = len(group_by_data_id(self._carry_over_rollouts))
        n_new = self.settings.window - n_carry_over
        return self.loader.take(max(n_new, 0))

    async def _apply_staleness_cap(self) -> int:
        """Abort carry-over groups older than `max_carry_over_age_steps`; re-queue their prompts."""
        cap = self.settings.max_carry_over_age_steps
        if cap is None or not self._carry_over_rollouts:
            return 0
        kept: list[TrackedRollout] = []
        aborted: list[str] = []
        for data_id, group in group_by_data_id(self._carry_over_rollouts).items():
            age = self.global_step - group[0].enqueued_step
            if age > cap and self.settings.partial_rollout:
                # Its tokens may be younger than the group (partial rollout continues calls
                # across updates): what is stale is its oldest token, never older than this.
                oldest = oldest_token_version(
                    await asyncio.gather(*(self.client.triplets(r.rollout_id) for r in group))
                )
                age = 0 if oldest is None else self.policy_version - oldest
            if age > cap and not all(r.state.terminal for r in group):
                aborted += [r.rollout_id for r in group if not r.state.terminal]
                self.loader.requeue(Prompt(data_id=data_id, input=group[0].input))
            else:
                kept += group
        if aborted:
            await self._backend.abort(aborted, f"stale: older than {cap} updates")
        self._carry_over_rollouts = kept
        return len(aborted)

    def _group_filter(self) -> GroupFilter | None:
        """`algorithm.filter_groups`: complete groups whose members all score alike leave the
        window and new prompts take their place."""
        if not self.settings.filter_groups:
            return None
        return GroupFilter(
            scores=self._group_scores,
            top_up=lambda n: self.loader.take(n),
            max_filtered=self.settings.max_filtered_groups,
        )

    def _reward(self, rollout: TrackedRollout, reported: float | None) -> float:
        return rollout_reward(rollout, reported, self.settings.reward_fillna_value)

    async def _group_scores(self, group: list[TrackedRollout]) -> list[float]:
        """What `algorithm.filter_groups.metric` compares within a group: the reward (score,
        seq_reward, seq_final_reward) or whether it is positive (acc)."""
        bundles = await asyncio.gather(*(self.client.triplets(r.rollout_id) for r in group))
        for rollout, bundle in zip(group, bundles):
            self._bundles[rollout.rollout_id] = bundle
        rewards = [self._reward(r, b.reward) for r, b in zip(group, bundles)]
        if self.settings.filter_metric == "acc":
            return [float(r > 0) for r in rewards]
        return rewards

    async def _rollout(self, new_prompts: list[Prompt]) -> tuple[GroupedResult, int, float]:
        await self.gateway.resume()
        result = await self.manager.enqueue_and_wait_until_group_completed(
            new_prompts,
            self._carry_over_rollouts,
            target_finished_group_num=self.settings.train_batch_size,
            step=self.global_step,
        )
        if self.settings.async_enabled:
            self._carry_over_rollouts = result.new_carry_over_rollouts
        else:
            leftovers = [r.rollout_id for r in result.new_carry_over_rollouts if not r.state.terminal]
            if leftovers:
                await self._backend.abort(leftovers, "synchronous mode keeps no carry-over")
            self._carry_over_rollouts = []
        inflight_at_pause, drain_seconds = await self.gateway.pause_and_drain(self.global_step, self.progress)
        return result, inflight_at_pause, drain_seconds

    async def _bundle(self, rollout_id: str) -> Any:
        cached = self._bundles.pop(rollout_id, None)
        return cached if cached is not None else await self.client.triplets(rollout_id)

    # -- the update's inputs --------------------------------------------------------------

    def _learning_rate(self) -> float:
        """The schedule's learning rate for the update at `global_step` (a pure function of the
        step, so a resumed run picks it up where it stopped)."""
        lr = self.settings.learning_rate
        total = self.total_steps
        factor = lr_factor(
            self.global_step,
            warmup=warmup_steps(lr.warmup_steps, lr.warmup_ratio, total),
            total=total,
            kind=lr.kind,
            min_lr_ratio=lr.min_lr_ratio,
            num_cycles=lr.num_cycles,
        )
        return lr.peak * factor

    def _adapt_kl_coef(self, update_metrics: dict[str, float], n_rollouts: int) -> None:
        """The adaptive KL-in-reward controller moves toward `kl_ctrl.target_kl`."""
        kl = self.settings.kl_in_reward
        current = update_metrics.get("actor/reward_kl_penalty")
        if kl.enabled and kl.controller == "adaptive" and current is not None:
            self.kl_coef = adaptive_kl_coef(self.kl_coef, current, n_rollouts, kl.target_kl, kl.horizon)

    def _check_failing(self, completed: list[TrackedRollout], n_failed: int) -> None:
        """Counts steps in a row whose `completed` rollouts all failed (`n_failed` of them, as
        `collect_samples` counted) and stops the run at `trainer.max_failed_steps`."""
        self._failed_steps = self._failed_steps + 1 if completed and n_failed == len(completed) else 0
        limit = self.settings.max_failed_steps
        if limit and self._failed_steps >= limit:
            raise RolloutsFailing(
                f"every rollout of the last {self._failed_steps} steps failed (trainer.max_failed_steps="
                f"{limit}); the latest error: {completed[-1].error_message or 'none recorded'}"
            )

    # -- the step -------------------------------------------------------------------------

    async def train_step(self) -> dict[str, float]:
        step = self.global_step
        step_started = self.clock()
        n_stale = await self._apply_staleness_cap()
        new_prompts = self._next_train_batch_dict_for_rollout()
        n_prev_carry_over = len(self._carry_over_rollouts)
        rollout_started = self.clock()
        result, inflight, drain = await self._rollout(new_prompts)
        previous_pause = self.gateway.last_pause_seconds  # measured by this step's resume
        rollout_wait = self.clock() - rollout_started - drain

        batch, sample_metrics = await collect_samples(
            result.completed_groups,
            self._bundle,
            self.settings.samples,
            fill=self.settings.reward_fillna_value,
            policy_version=self.policy_version,
        )
        if self.images is not None:
            batch, mismatched = await self.images.attach(batch)
            sample_metrics["training/n_image_mismatch_samples"] = mismatched
        samples = batch.samples
        completed = [r for g in result.completed_groups for r in g]
        self._check_failing(completed, int(sample_metrics["rollouts/n_failed"]))
        update_metrics: dict[str, float] = {}
        update_s = sync_s = 0.0
        counts_after_sync: ProxyState | None = None  # partial rollout: see spanning_metrics
        n_engines = await self._live_engines()
        if samples:
            self.progress.update(0, 0)
            await self.weight_sync.before_update()
            update_started = self.clock()
            update_metrics = await asyncio.to_thread(
                self.actor.update, batch, self.rng, lr=self._learning_rate(), kl_coef=self.kl_coef
            )
            update_s = self.clock() - update_started
            self._adapt_kl_coef(update_metrics, len(batch.rollouts))
            self.policy_version += 1
            self.progress.weight_sync()
            sync_started = self.clock()
            await self.weight_sync.sync(self.actor, self.policy_version)
            sync_s = self.clock() - sync_started
            if self.settings.partial_rollout:
                counts_after_sync = await self.client.proxy_state()
        else:
            # An update on nothing would still bump the version and move the optimizer state;
            # the step is consumed (and counted) but the policy stays as it was.
            log.warning(
                "step %d: the %d completed group(s) have no samples (failed: %d, no recorded calls); "
                "the policy is not updated",
                step,
                len(result.completed_groups),
                int(sample_metrics["rollouts/n_failed"]),
            )
        self.global_step += 1

        step_s = self.clock() - step_started
        metrics: dict[str, float] = {
            **window_metrics(step, n_prev_carry_over, result, inflight, drain),
            **sample_metrics,
            **update_metrics,
            **spanning_metrics(self.gateway.boundary_counts, counts_after_sync),
            **self.gateway.unhonoured(),
            "training/async/n_aborted_stale_rollouts": n_stale,
            "training/n_filtered_groups": len(result.filtered_groups),
            "training/update_skipped": 0.0 if samples else 1.0,
            "timing/step_s": step_s,
            "timing/rollout_wait_s": rollout_wait,
            "timing/update_s": update_s,
            "timing/weight_sync_s": sync_s,
            "trainer/world_size": self.world_size,
            "rollout/n_engines": n_engines,
            # Every token of every sample, through each PPO epoch (π_old's pass not counted).
            "perf/update_tokens_per_s": (
                sum(len(s) for s in samples) * self.settings.ppo_epochs / update_s if update_s > 0 else 0.0
            ),
            # The pause that ended as this step's rollout began: drain, update, weight sync
            # and anything else the previous step did while agents were held off.
            "timing/gateway_pause_s": previous_pause or 0.0,
            # The trainer idles while it waits for complete groups and for the drain.
            "timing/trainer_idle_s": rollout_wait + drain,
            "timing/trainer_idle_fraction": (rollout_wait + drain) / step_s if step_s > 0 else 0.0,
        }
        return metrics

    async def _live_engines(self) -> int:
        """Engines the gateway routes to now (those registered and live)."""
        return sum(1 for m in await self.client.list_models() if m.live)

    # -- evaluation -----------------------------------------------------------------------

    async def validate(self) -> dict[str, float]:
        """Every held-out task once (n = 1, val mode), waited to completion."""
        if not self.val_tasks:
            return {}
        await self.gateway.resume()
        tasks = self.val_tasks[: self.settings.val_batch_size]
        prompts = [Prompt(data_id=f"val-{self.global_step}-{i}", input=task) for i, task in enumerate(tasks)]
        self.progress.evaluation(0, len(prompts))
        val_manager = AsyncRolloutManager(
            self._backend,
            train_rollout_n=1,
            on_poll=lambda window: self.progress.evaluation(window.completed_groups, window.target_groups),
        )
        result = await val_manager.enqueue_and_wait_until_group_completed(
            prompts, [], target_finished_group_num=len(prompts), step=self.global_step, is_train=False
        )
        rollouts = [r for g in result.completed_groups for r in g]
        bundles = await asyncio.gather(*(self.client.triplets(r.rollout_id) for r in rollouts))
        rewards = [self._reward(r, b.reward) for r, b in zip(rollouts, bundles)]
        return {
            "val/reward_mean": statistics.fmean(rewards),
            "val/accuracy": sum(x > 0 for x in rewards) / len(rewards),
            "val/n_failed": sum(r.state == RolloutState.FAILED for r in rollouts),
        }

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "policy_version": self.policy_version,
            "loader": self.loader.state_dict(),
            "carry_over_rollouts": [r.to_json() for r in self._carry_over_rollouts],
            "rng": self.rng.getstate(),
            "kl_coef": self.kl_coef,
        }

    def save_checkpoint(self) -> Path:
        assert self.run_dir is not None
        state = self.state_dict()
        state["rng"] = [state["rng"][0], list(state["rng"][1]), state["rng"][2]]
        return save_checkpoint(self.run_dir, self.global_step, self.actor, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = state["global_step"]
        self.policy_version = state["policy_version"]
        self.loader.load_state_dict(state["loader"])
        self._carry_over_rollouts = [TrackedRollout.from_json(r) for r in state["carry_over_rollouts"]]
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        self.kl_coef = state.get("kl_coef", self.kl_coef)

    async def reconcile_after_restart(self) -> int:
        """After a crash the agents of unfinished rollouts are gone: abort every rollout still
        queued or running in the store. A carry-over group that lost a member, to that or to an
        earlier abort (a finished run aborts its carry-over after its last checkpoint), would
        be trained on as a failure: it is dropped and its prompt re-queued."""
        stranded = await self.client.list_rollouts(state_in=[RolloutState.QUEUING, RolloutState.RUNNING])
        await self._backend.abort([r.rollout_id for r in stranded], "trainer restarted")
        ids = [r.rollout_id for r in self._carry_over_rollouts]
        carried = {r.rollout_id: r for r in await self.client.list_rollouts(rollout_ids=ids)}

        def lost(rollout_id: str) -> bool:
            found = carried.get(rollout_id)
            return found is None or found.aborted or not found.state.terminal

        kept: list[TrackedRollout] = []
        for data_id, group in group_by_data_id(self._carry_over_rollouts).items():
            if any(lost(r.rollout_id) for r in group):
                self.loader.requeue(Prompt(data_id=data_id, input=group[0].input))
            else:
                kept += group
        self._carry_over_rollouts = kept
        return len(stranded)

    async def abort_carry_over(self, reason: str) -> None:
        pending = [r.rollout_id for r in self._carry_over_rollouts if not r.state.terminal]
        if pending:
            await self._backend.abort(pending, reason)

    # -- the loop -------------------------------------------------------------------------

    def _log(self, metrics: dict[str, float]) -> None:
        self.history.append({"step": self.global_step, **metrics})
        if self.metrics is not None:
            self.metrics.log(self.global_step, metrics)

    @property
    def total_steps(self) -> int:
        """Updates of the run (`trainer.total_training_steps`, else `total_epochs` passes)."""
        return self.settings.total_steps(len(self.train_tasks))

    def _checkpoint_due(self, last: bool) -> bool:
        freq = self.settings.save_freq
        return self.run_dir is not None and freq >= 0 and (last or (freq > 0 and self.global_step % freq == 0))

    async def fit(self) -> list[dict[str, float]]:
        total = self.total_steps
        if self.global_step == 0 and self.settings.val_before_train:
            val = await self.validate()
            if val:
                self._log(val)
        while self.global_step < total:
            self.progress.step_started(self.global_step + 1, total)  # the step its metrics are logged at
            metrics = await self.train_step()
            last = self.global_step == total
            test_freq = self.settings.test_freq
            if test_freq > 0 and self.global_step % test_freq == 0 and not last:
                metrics.update(await self.validate())
            self._log(metrics)
            self.progress.step_finished(self.global_step, metrics)
            if self._checkpoint_due(last):
                self.save_checkpoint()
        await self.abort_carry_over("training finished")
        val = await self.validate()
        if val:
            self._log(val)
        return self.history


def window_metrics(
    step: int, n_prev_carry_over: int, result: GroupedResult, inflight: int, drain: float
) -> dict[str, float]:
    """The seed's `training/async/*` and `timing/rollout_*` metrics of one step's window."""
    completed = [r for g in result.completed_groups for r in g]
    # Updates the carry-over has lived through once this step's update is done.
    ages = [step + 1 - r.enqueued_step for r in result.new_carry_over_rollouts]
    metrics: dict[str, float] = {
        "training/async/n_prev_carry_over_rollouts": n_prev_carry_over,
        "training/async/n_completed_rollouts": len(completed),
        "training/async/n_new_carry_over_rollouts": len(result.new_carry_over_rollouts),
        "training/async/new_carry_over_age_max_steps": max(ages) if ages else 0,
        "training/async/proxy_inflight_at_pause": inflight,
        "training/async/proxy_drain_seconds": drain,
        # rollouts consumed now that were enqueued in an earlier step: carry-over paying off
        "training/async/n_completed_from_carry_over": sum(r.enqueued_step < step for r in completed),
    }
    timed = [
        (r.created_at, r.started_at, r.finished_at)
        for r in completed
        if r.created_at is not None and r.finished_at is not None
    ]
    queue_wait = [started - created for created, started, _ in timed if started is not None]
    run = [finished - started for _, started, finished in timed if started is not None]
    total = [finished - created for created, _, finished in timed]
    metrics.update(summarize("timing/rollout_queue_wait_s", queue_wait))
    metrics.update(summarize("timing/rollout_run_duration_s", run))
    metrics.update(summarize("timing/rollout_total_s", total))
    return metrics
