"""verl's update modes on a real (tiny) transformer, one rank: bypass mode, the entropy bonus,
the KL loss and the KL in the reward against a frozen reference, rejection sampling,
Agent Lightning's per_rollout_mean and max_ppo_update_times, and the LR the trainer schedules.
(1 rank vs 2 ranks for every mode: tests/distributed/test_update_ranks.py.)"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from rollover.config import load_config
from rollover.distributed.world import World
from rollover.training.loss.entropy import token_entropy
from rollover.training.loss.kl import kl_estimate
from rollover.training.prepare import prepare_update
from rollover.training.reference import Reference
from rollover.training.samples import RolloutScore, Sample, UpdateBatch
from tests.training.test_policy_update import make_sample, tiny_policy, update, with_behaviour_of

GOOD, BAD = [2, 3, 4, 5, 6, 7], [2, 3, 4, 8, 9, 10]


def weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def frozen_copy(policy) -> Reference:
    """A reference policy holding a copy of `policy`'s weights as they are now."""
    reference = Reference.__new__(Reference)
    reference.settings, reference.world = policy.settings.reference, World()
    reference.device, reference.moves = policy.device, False
    reference.model = copy.deepcopy(policy.model).eval().requires_grad_(False)
    return reference


def token_logprobs_of(model, sample: Sample) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([sample.input_ids])).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(sample.input_ids[1:]).unsqueeze(-1)).squeeze(-1)


def test_bypass_mode_takes_the_recomputed_step_without_the_old_logprob_pass():
    """μ equal to π_old: bypass (μ as π_old) must take the step the recomputed π_old takes,
    with one forward pass fewer per micro-batch of π_old."""
    results = {}
    for bypass in (False, True):
        policy = tiny_policy([f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}"])
        samples = with_behaviour_of(policy, [make_sample(GOOD, 1.0, "a"), make_sample(BAD, -1.0, "b")])
        passes: list[int] = []
        hook = policy.model.register_forward_hook(lambda *_, seen=passes: seen.append(1))
        update(policy, samples)
        hook.remove()
        results[bypass] = weights(policy), len(passes)
    (decoupled, decoupled_passes), (bypassed, bypassed_passes) = results[False], results[True]
    assert max_difference(decoupled, bypassed) < 1e-5
    assert bypassed_passes == decoupled_passes - 1  # the two samples' π_old ran as one pass


def test_entropy_bonus_raises_the_entropy_and_the_metric_is_the_token_mean():
    policy = tiny_policy(["actor_rollout_ref.actor.entropy_coeff=1.0", "actor_rollout_ref.actor.optim.lr=1e-3"])
    sharpen = tiny_policy(["actor_rollout_ref.actor.optim.lr=3e-2"])  # a peaked policy, far from uniform
    for _ in range(5):
        update(sharpen, [make_sample(GOOD, 1.0, "a"), make_sample(BAD, 0.0, "b")])
    policy.model.load_state_dict(sharpen.model.state_dict())
    samples = [make_sample(GOOD, 1.0, "a"), make_sample(BAD, 1.0, "b")]  # alike rewards: no policy gradient

    def mean_entropy() -> float:
        values = []
        for s in samples:
            with torch.no_grad():
                logits = policy.model(torch.tensor([s.input_ids])).logits[:, :-1]
            values += token_entropy(logits)[0, 2:].tolist()  # the trained (target-aligned) tokens
        return sum(values) / len(values)

    before = mean_entropy()
    metrics = update(policy, samples)
    assert metrics["actor/entropy"] == pytest.approx(before, rel=1e-5)  # measured before the step
    for _ in range(3):
        update(policy, samples)
    assert mean_entropy() > before + 1e-2


def test_without_an_entropy_bonus_alike_rewards_move_nothing():
    policy = tiny_policy()
    before = weights(policy)
    metrics = update(policy, [make_sample(GOOD, 1.0, "a"), make_sample(BAD, 1.0, "b")])
    assert metrics["actor/n_skipped_steps"] == 1 and max_difference(before, weights(policy)) == 0.0


def test_the_kl_loss_pulls_the_policy_back_toward_the_reference():
    policy = tiny_policy(["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=1.0"])
    policy.reference = frozen_copy(policy)
    for _ in range(4):  # drift away with the policy gradient alone
        update(policy, [make_sample(GOOD, 1.0, "a"), make_sample(BAD, -1.0, "b")])
    samples = [make_sample(GOOD, 0.0, "a"), make_sample(BAD, 0.0, "b")]  # now only the KL term has a gradient

    def kl_to_reference() -> float:
        return sum(
            float(
                kl_estimate(token_logprobs_of(policy.model, s), token_logprobs_of(policy.reference.model, s), "k3")[
                    2:
                ].sum()
            )
            for s in samples
        )

    drifted = kl_to_reference()
    assert drifted > 1e-3
    metrics = update(policy, samples)
    assert metrics["actor/kl_loss"] > 0 and metrics["actor/kl_coef"] == 1.0
    for _ in range(5):
        update(policy, samples)
    assert kl_to_reference() < 0.5 * drifted


def test_the_kl_in_the_reward_is_subtracted_before_the_group_baseline():
    """Two rollouts of one group with the same reward: only the KL penalty tells them apart, so
    the one further from the reference gets the negative advantage."""
    policy = tiny_policy(["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k2"])
    policy.reference = frozen_copy(policy)
    update(policy, [make_sample(GOOD, 1.0, "a"), make_sample(BAD, -1.0, "b")])  # the policy drifts
    samples = [make_sample(GOOD, 1.0, "a"), make_sample(BAD, 1.0, "b")]
    kl = {
        s.rollout_id: float(
            kl_estimate(token_logprobs_of(policy.model, s), token_logprobs_of(policy.reference.model, s), "k2")[
                2:
            ].sum()
        )
        for s in samples
    }
    assert kl["a"] != pytest.approx(kl["b"])
    rollouts = [RolloutScore(s.rollout_id, "g", 1.0) for s in samples]
    prepared = prepare_update(samples, rollouts, policy.recompute(samples), policy.settings.update, kl_coef=0.5)
    advantage = {row.sample.rollout_id: float(row.advantages.max() + row.advantages.min()) for row in prepared.rows}
    metrics = policy.update(UpdateBatch(samples, rollouts), random.Random(0), lr=1e-2, kl_coef=0.5)
    further, nearer = sorted(samples, key=lambda s: -kl[s.rollout_id])
    assert advantage[further.rollout_id] < 0 < advantage[nearer.rollout_id]
    assert metrics["critic/rewards/mean"] == pytest.approx(1.0 - 0.5 * (kl["a"] + kl["b"]) / 2, rel=1e-4)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5 and metrics["actor/reward_kl_penalty"] > 0


def test_rejected_samples_train_as_if_they_were_absent():
    """Token rejection sampling: a sample whose μ is 5x less likely than π_old on every token
    (ratio 5 > rollout_rs_threshold 2) leaves the step exactly as if it were not there."""
    rs = ["algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=2.0"]
    with_rejection = tiny_policy(rs)
    samples = with_behaviour_of(
        with_rejection,
        [make_sample(GOOD, 1.0, "a"), make_sample(BAD, -1.0, "b"), make_sample([2, 3, 4, 11, 12], 1.0, "c", group="h")],
        log_ratios=[0.0, 0.0, math.log(5.0)],
    )
    metrics = update(with_rejection, samples)
    without = tiny_policy()
    update(without, samples[:2])
    assert max_difference(weights(with_rejection), weights(without)) < 1e-6
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 8)  # c's 2 of the 8 tokens


def test_per_rollout_mean_weighs_every_rollout_the_same_however_many_samples_it_has():
    """At π_θ = π_old every trained token's PPO loss is -A, so Agent Lightning's per_rollout_mean
    is -Σ_rollouts A / rows, whatever the lengths; the token-mean weighs by tokens."""
    samples = [
        make_sample([2, 3, 4, 5, 6, 7, 8, 9], 1.0, "r1", group="g1"),  # r1: two samples, 5 + 2 tokens
        make_sample([2, 3, 4, 10, 11], 1.0, "r1", group="g1"),
        make_sample([2, 3, 4, 12], 0.5, "r2", group="g2"),  # r2: one sample, 1 token
    ]
    per_rollout = update(tiny_policy(["actor_rollout_ref.actor.policy_loss.loss_mode=per_rollout_mean"]), samples)
    assert per_rollout["actor/pg_loss"] == pytest.approx(-(1.0 + 0.5) / 3, rel=1e-5)
    token_mean = update(tiny_policy(), samples)
    assert token_mean["actor/pg_loss"] == pytest.approx(-(1.0 * 7 + 0.5 * 1) / 8, rel=1e-5)


def test_max_ppo_update_times_drops_the_groups_without_signal_first():
    policy = tiny_policy(
        [
            "agentlightning.max_ppo_update_times=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.n=2",
        ]
    )
    rewards = {"g1": (1.0, 1.0), "g2": (0.0, 0.0), "g3": (1.0, 0.0), "g4": (0.0, 1.0)}
    samples = [
        make_sample([2, 3, 4, 5 + k, 6], reward, f"{group}-{k}", group=group)
        for group, pair in rewards.items()
        for k, reward in enumerate(pair)
    ]
    steps = []

    class Count:
        def update(self, done, total):
            steps.append(total)

    policy.progress = Count()
    metrics = update(policy, samples)
    assert steps[-1] == 2  # two mini-batches of 1 prompt x 2 samples
    assert metrics["training/n_sample_dropped/same_reward"] == 4.0
    assert metrics["training/n_sample_dropped/random"] == 0.0


def test_the_update_runs_at_the_learning_rate_the_trainer_schedules():
    from rollover.training.settings import TrainerSettings
    from rollover.training.trainer import Trainer

    config = load_config(
        None,
        [
            "trainer.total_training_steps=10",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.2",
            "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
        ],
    )
    trainer = Trainer(
        settings=TrainerSettings.from_config(config), client=None, actor=None, weight_sync=None, train_tasks=[{"id": 1}]
    )  # type: ignore[arg-type]
    rates = []
    for step in range(10):
        trainer.global_step = step
        rates.append(trainer._learning_rate())
    assert rates[0] == 0.0 and rates[1] == pytest.approx(0.5e-3)  # warm-up: 2 of 10 steps
    assert rates[2] == pytest.approx(1e-3)  # the peak, then the cosine down to the floor
    assert all(a > b for a, b in zip(rates[2:], rates[3:]))
    assert rates[9] > 1e-4 and rates[9] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    policy = tiny_policy()
    metrics = policy.update(
        UpdateBatch([make_sample(GOOD, 1.0, "a"), make_sample(BAD, -1.0, "b")],
                    [RolloutScore("a", "g", 1.0), RolloutScore("b", "g", -1.0)]),
        random.Random(0), lr=rates[5],
    )  # fmt: skip
    assert metrics["actor/lr"] == pytest.approx(rates[5])


def test_the_adaptive_kl_coefficient_moves_and_is_checkpointed():
    from rollover.training.settings import TrainerSettings
    from rollover.training.trainer import Trainer

    config = load_config(
        None,
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1",
         "algorithm.kl_ctrl.horizon=100", "algorithm.kl_ctrl.kl_coef=0.2"],
    )  # fmt: skip
    trainer = Trainer(
        settings=TrainerSettings.from_config(config), client=None, actor=None, weight_sync=None, train_tasks=[{"id": 1}]
    )  # type: ignore[arg-type]
    trainer._adapt_kl_coef({"actor/reward_kl_penalty": 1.0}, n_rollouts=10)  # far above target: +20% x 10/100
    assert trainer.kl_coef == pytest.approx(0.2 * 1.02)
    resumed = Trainer(
        settings=TrainerSettings.from_config(config), client=None, actor=None, weight_sync=None, train_tasks=[{"id": 1}]
    )  # type: ignore[arg-type]
    state = trainer.state_dict()
    state["rng"] = [state["rng"][0], list(state["rng"][1]), state["rng"][2]]
    resumed.load_state_dict(state)
    assert resumed.kl_coef == trainer.kl_coef
