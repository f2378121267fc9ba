"""From the complete groups of a step to the update's batch: every rollout's recorded calls
merged into samples (`samples.build_samples`), its reward (or the fill value when it failed or
reported none), and what the batch holds as metrics (scores, failures, lengths, staleness)."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rollover.store.models import RolloutState
from rollover.training.manager import TrackedRollout
from rollover.training.samples import RolloutScore, Sample, UpdateBatch, build_samples, spans_cover_response
from rollover.training.settings import SampleBudget


def rollout_reward(rollout: TrackedRollout, reported: float | None, fill: float) -> float:
    """A consumed rollout's reward: what it reported, or `fill` (`algorithm.reward_fillna_value`)
    when it failed or reported none."""
    return fill if rollout.state == RolloutState.FAILED or reported is None else reported


async def collect_samples(
    groups: Sequence[Sequence[TrackedRollout]],
    bundle_of: Callable[[str], Awaitable[Any]],
    budget: SampleBudget,
    *,
    fill: float,
    policy_version: int,
) -> tuple[UpdateBatch, dict[str, float]]:
    """The groups' samples and rollouts, and the batch's metrics; `bundle_of(rollout_id)` is
    the rollout's recorded calls and reward (the gateway's triplet bundle)."""
    rewards: list[float] = []
    rollouts: list[RolloutScore] = []
    all_samples: list[Sample] = []
    n_failed = n_missing_reward = n_timeout = n_overlong = n_malformed = 0
    flat = [r for g in groups for r in g]
    bundles = await asyncio.gather(*(bundle_of(r.rollout_id) for r in flat))
    for rollout, bundle in zip(flat, bundles):
        if rollout.state == RolloutState.FAILED:
            n_failed += 1
            n_timeout += (rollout.error_message or "").startswith("timeout")
        elif bundle.reward is None:
            n_missing_reward += 1
        reward = rollout_reward(rollout, bundle.reward, fill)
        triplets = [t.model_dump() for t in bundle.triplets]
        kept = [t for t in triplets if spans_cover_response(t)]
        n_malformed += len(triplets) - len(kept)  # its tokens are not trained: they may not be μ's
        triplets = kept
        samples = (
            build_samples(
                rollout.rollout_id,
                rollout.data_id,
                triplets,
                reward,
                budget.max_length,
                budget.merge,
                cut="left" if budget.truncation == "left" else "right",
            )
            if triplets
            else []
        )
        if budget.truncation == "error":  # an over-long sample is not trained on, and counted
            n_overlong += sum(s.truncated for s in samples)
            samples = [s for s in samples if not s.truncated]
        rewards.append(reward)
        rollouts.append(RolloutScore(rollout.rollout_id, rollout.data_id, reward))
        all_samples += samples
    lags = [policy_version - v for s in all_samples for v, m in zip(s.token_versions, s.loss_mask) if m and v >= 0]
    metrics = {
        "critic/score/mean": statistics.fmean(rewards) if rewards else 0.0,
        "critic/score/max": max(rewards, default=0.0),
        "critic/score/min": min(rewards, default=0.0),
        "reward/accuracy": sum(r > 0 for r in rewards) / max(len(rewards), 1),
        "rollouts/n_failed": n_failed,
        "rollouts/n_timeout": n_timeout,
        "rollouts/n_missing_reward": n_missing_reward,
        "rollouts/n_samples": len(all_samples),
        "rollouts/n_response_tokens": sum(s.num_loss_tokens for s in all_samples),
        "training/n_overlong_samples": n_overlong,
        "training/n_malformed_calls": n_malformed,
        "policy/version": policy_version,
        "policy/version_lag_mean": statistics.fmean(lags) if lags else 0.0,
        "policy/version_lag_max": max(lags) if lags else 0.0,
        **length_metrics(all_samples, budget.response_budget),
    }
    return UpdateBatch(all_samples, rollouts), metrics


def length_metrics(samples: Sequence[Sample], response_budget: int) -> dict[str, float]:
    """verl's length metrics, per sample: the prompt is what precedes its first trained token,
    the response the rest (tool tokens of later turns included); a response is clipped when it
    reached its budget."""
    if not samples:
        return {}
    prompts = [s.loss_mask.index(1) for s in samples]
    responses = [len(s) - p for s, p in zip(samples, prompts)]
    clipped = [s.truncated or r >= response_budget for s, r in zip(samples, responses)]
    return {
        "response_length/mean": statistics.fmean(responses),
        "response_length/max": max(responses),
        "response_length/min": min(responses),
        "response_length/clip_ratio": sum(clipped) / len(samples),
        "prompt_length/mean": statistics.fmean(prompts),
        "prompt_length/max": max(prompts),
        "prompt_length/min": min(prompts),
    }
