"""The rooms of the update path on their own: the plan, the preparation (pure: it never changes
the caller's samples) and the micro-batch objective (a pure function whose micro-batch shares
add up to the mini-batch's loss, however the mini-batch is split)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rollover.config import load_config
from rollover.training.advantages import Unit
from rollover.training.loss.aggregate import mini_batch_counts
from rollover.training.objective import Forward, micro_batch_objective
from rollover.training.plan import plan_update
from rollover.training.prepare import Recomputed, prepare_update
from rollover.training.samples import RolloutScore, Sample, UpdateBatch
from rollover.training.update_settings import PlanSettings, UpdateSettings


def sample(rid: str, group: str, n_prompt: int, n_response: int, reward: float, policy: str | None = None) -> Sample:
    n = n_prompt + n_response
    mask = [0] * n_prompt + [1] * n_response
    behaviour = [0.0] * n_prompt + [-1.0 - 0.1 * k for k in range(n_response)]
    return Sample(rid, group, list(range(2, 2 + n)), mask, behaviour, [0] * n, reward, policy=policy)


def batch() -> UpdateBatch:
    samples = [
        sample("r0", "g", 2, 3, 1.0),
        sample("r1", "g", 2, 2, 0.0),
        sample("r1", "g", 3, 4, 0.0),
        sample("r2", "h", 1, 5, 1.0),
    ]
    rollouts = [RolloutScore("r0", "g", 1.0), RolloutScore("r1", "g", 0.0), RolloutScore("r2", "h", 1.0)]
    return UpdateBatch(samples, rollouts)


def settings(*overrides: str) -> UpdateSettings:
    return UpdateSettings.from_config(load_config(None, list(overrides)))


def recomputed(samples: list[Sample], shift: float = 0.0) -> list[Recomputed]:
    return [Recomputed(torch.tensor(s.behaviour_logprobs[1:]) + shift) for s in samples]


# ---------------------------------------------------------------- the plan


def test_the_plan_shuffles_each_epoch_into_mini_batches_of_prompts_times_n() -> None:
    plan = plan_update(batch(), PlanSettings(ppo_epochs=2, mini_batch_prompts=1, rollout_n=2), random.Random(0), lr=0.1)
    assert [len(step) for step in plan.steps] == [2, 2, 2, 2]  # 4 samples, 2 a step, 2 epochs
    assert sorted(plan.steps[0] + plan.steps[1]) == sorted(plan.steps[2] + plan.steps[3]) == [0, 1, 2, 3]
    again = plan_update(
        batch(), PlanSettings(ppo_epochs=2, mini_batch_prompts=1, rollout_n=2), random.Random(0), lr=0.1
    )
    assert again.steps == plan.steps and again.seed == plan.seed  # a pure function of its inputs


def test_the_plan_keeps_one_policys_samples_to_a_step() -> None:
    samples = [sample(f"r{i}", "g", 2, 2, float(i % 2), policy=("a", "b")[i % 2]) for i in range(6)]
    plan = plan_update(
        UpdateBatch(samples, []),
        PlanSettings(mini_batch_prompts=1, rollout_n=2, policies=("a", "b")),
        random.Random(1),
        lr=0.1,
    )
    assert all(len({plan.samples[i].policy for i in step}) == 1 for step in plan.steps)


# ---------------------------------------------------------------- the preparation


def test_preparation_never_changes_the_callers_samples() -> None:
    given = batch()
    before = copy.deepcopy(given.samples)
    update = settings("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token")
    prepared = prepare_update(given.samples, given.rollouts, recomputed(given.samples, 0.3), update)
    assert given.samples == before
    assert [row.sample for row in prepared.rows] == given.samples


def test_every_sample_of_a_unit_carries_its_advantage_on_its_trained_tokens() -> None:
    given = batch()
    prepared = prepare_update(
        given.samples, given.rollouts, recomputed(given.samples), settings("algorithm.norm_adv_by_std_in_grpo=false")
    )
    # group g: r0 = 1, r1 = 0 -> ±0.5 (Dr. GRPO); h: r2 alone -> its reward 1
    expected = {Unit("r0"): 0.5, Unit("r1"): -0.5, Unit("r2"): 1.0}
    for row in prepared.rows:
        mask = torch.tensor(row.sample.loss_mask[1:], dtype=torch.float32)
        assert torch.equal(row.advantages, expected[row.unit] * mask)


def test_rejection_leaves_the_trained_mask_and_per_rollout_divisors_count_what_is_kept() -> None:
    given = batch()
    update = settings(
        "algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=2.0"
    )
    olds = recomputed(given.samples)
    olds[3] = Recomputed(olds[3].old.clone())
    olds[3].old[-1] += 1.0  # π_old/μ = e > 2 on r2's last token: rejected
    prepared = prepare_update(given.samples, given.rollouts, olds, update)
    assert prepared.rows[3].trained.sum() == 4 and prepared.rows[3].trained[-1] == 0
    # per_rollout_mean (the default): r1's rows share 2 + 4 kept tokens, 4 rows in the batch
    assert [row.divisor for row in prepared.rows] == [3 * 4, 6 * 4, 6 * 4, 4 * 4]


# ---------------------------------------------------------------- the objective


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"],
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        ],
        ["actor_rollout_ref.actor.policy_loss.loss_mode=per_rollout_mean", "actor_rollout_ref.actor.entropy_coeff=0.1"],
        ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
        ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"],
    ],
)
def test_micro_batch_shares_add_up_to_the_mini_batchs_loss(overrides: list[str]) -> None:
    given = batch()
    update = settings(*overrides)
    rows = prepare_update(given.samples, given.rollouts, recomputed(given.samples), update).rows
    counts = mini_batch_counts([r.trained for r in rows], update.norm_length)
    torch.manual_seed(0)
    logprobs = [r.old + 0.05 * torch.randn_like(r.old) for r in rows]
    entropy = [torch.rand_like(r.old) for r in rows]

    def objective(indices: list[int]) -> float:
        width = max(len(rows[i].old) for i in indices)
        pad = lambda ts: torch.stack([torch.nn.functional.pad(ts[i], (0, width - len(ts[i]))) for i in indices])  # noqa: E731
        forward = Forward(pad(logprobs), pad(entropy))
        return float(micro_batch_objective(forward, [rows[i] for i in indices], counts, update).loss)

    whole = objective([0, 1, 2, 3])
    assert objective([0, 2]) + objective([1, 3]) == pytest.approx(whole, abs=1e-6)
    assert objective([0]) + objective([1]) + objective([2]) + objective([3]) == pytest.approx(whole, abs=1e-6)
    assert objective([0, 1, 2, 3]) == whole  # the same inputs, the same value: nothing is kept between calls
