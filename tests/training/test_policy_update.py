"""One PPO update on a real (tiny) transformer moves probability toward rewarded responses."""

import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollover.config import load_config
from rollover.training.actor import Actor
from rollover.training.samples import RolloutScore, Sample, UpdateBatch
from rollover.training.update_settings import ActorSettings


class _Tok:
    pad_token_id = 0
    eos_token_id = 1


def tiny_policy(overrides=()) -> Actor:
    """A tiny actor in memory, with the settings of the defaults plus `overrides` (its config
    kept as `.config` for the tests' own reading)."""
    torch.manual_seed(0)
    config = load_config(
        None,
        [
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.device=cpu",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",  # verl's token-mean unless a test says
            *overrides,
        ],
    )
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    )
    actor = Actor(model, _Tok(), ActorSettings.from_config(config))
    actor.config = config  # type: ignore[attr-defined]
    return actor


def update(policy, samples, rng=None):
    """One update on `samples`, each its own rollout whose reward is its `reward` (samples
    sharing a group id form a group: advantages are computed within it)."""
    rollouts = list({s.rollout_id: RolloutScore(s.rollout_id, s.group_id, s.reward) for s in samples}.values())
    lr = policy.config.actor_rollout_ref.actor.optim.lr
    return policy.update(UpdateBatch(samples, rollouts), rng or random.Random(0), lr=lr)


def sequence_logprob(policy, ids):
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return sum(logits[t, ids[t + 1]].item() for t in range(2, len(ids) - 1))


def make_sample(ids, reward, rid, group="g"):
    mask = [0, 0, 0] + [1] * (len(ids) - 3)
    return Sample(rid, group, ids, mask, [0.0] * len(ids), [0] * len(ids), reward=reward)


@pytest.mark.parametrize("rollout_is", [None, "token", "sequence"])
def test_update_raises_good_and_lowers_bad(rollout_is):
    policy = tiny_policy([f"algorithm.rollout_correction.rollout_is={rollout_is or 'null'}"])
    good, bad = [2, 3, 4, 5, 6, 7], [2, 3, 4, 8, 9, 10]
    before = sequence_logprob(policy, good), sequence_logprob(policy, bad)
    samples = [make_sample(good, 1.0, "a"), make_sample(bad, -1.0, "b")]
    # behaviour logprobs equal to the current policy's, as if sampled by it
    for s in samples:
        with torch.no_grad():
            lp = policy.model(torch.tensor([s.input_ids])).logits[0, :-1].log_softmax(-1)
        s.behaviour_logprobs = [0.0] + [lp[t, s.input_ids[t + 1]].item() for t in range(len(s.input_ids) - 1)]
    metrics = {}
    for _ in range(5):
        metrics = update(policy, samples)
    after = sequence_logprob(policy, good), sequence_logprob(policy, bad)
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5
    assert "actor/pg_clipfrac" in metrics and "actor/ppo_kl" in metrics
    if rollout_is:
        assert "rollout_corr/is_mean" in metrics


def test_zero_advantage_changes_nothing():
    policy = tiny_policy()
    ids = [2, 3, 4, 5, 6, 7]
    before = sequence_logprob(policy, ids)
    update(policy, [make_sample(ids, 0.0, "a"), make_sample(ids, 0.0, "b")])
    assert sequence_logprob(policy, ids) == pytest.approx(before, abs=1e-6)


def with_behaviour_of(policy, samples, log_ratios=None):
    """Behaviour logprobs as the current policy's, shifted by `log_ratios` (logπ_old - logμ)."""
    for k, s in enumerate(samples):
        with torch.no_grad():
            lp = policy.model(torch.tensor([s.input_ids])).logits[0, :-1].log_softmax(-1)
        shift = 0.0 if log_ratios is None else log_ratios[k]
        s.behaviour_logprobs = [0.0] + [lp[t, s.input_ids[t + 1]].item() - shift for t in range(len(s.input_ids) - 1)]
    return samples


def optimizer_steps(policy, samples):
    seen = []

    class Count:
        def update(self, done, total):
            seen.append(total)

    policy.progress = Count()
    update(policy, samples)
    return seen[-1]


@pytest.mark.parametrize("mini,n,steps", [(None, 4, 1), (1, 4, 2), (2, 4, 1), (1, 2, 4)])
def test_ppo_mini_batch_size_counts_prompts_times_rollout_n_as_in_verl(mini, n, steps):
    policy = tiny_policy(
        [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini if mini else 'null'}",
            f"actor_rollout_ref.rollout.n={n}",
        ]
    )
    samples = [make_sample([2, 3, 4, 5 + k % 3, 6], 1.0 if k % 2 else -1.0, f"r{k}") for k in range(8)]
    assert optimizer_steps(policy, samples) == steps


def test_the_token_mean_counts_the_target_aligned_mask():
    # A sample whose first token carries the loss mask (a response with no prompt): that token
    # is never predicted, so it must not count. At π_θ = π_old with A = 1 the token-mean loss
    # is exactly -1; counting the first token would report (and scale the gradient by) 3/4.
    policy = tiny_policy()
    ids = [2, 3, 4, 5]
    sample = Sample("a", "g", ids, [1, 1, 1, 1], [0.0] * 4, [0] * 4, reward=1.0)  # a group of one: A = 1
    assert sample.num_target_tokens == 3 and sample.num_loss_tokens == 4
    metrics = update(policy, [sample])
    assert metrics["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-6)


def test_rollout_correction_metrics_are_the_whole_batchs_before_truncation():
    # Two micro-batches of one sample each: μ three times less likely than π_old on every
    # token of the first sample (raw weight 3 > C = 2), equal on the second (weight 1).
    policy = tiny_policy(
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
            "actor_rollout_ref.actor.ppo_micro_batch_size=1",
        ]
    )
    samples = with_behaviour_of(
        policy,
        [make_sample([2, 3, 4, 5, 6, 7], 1.0, "a"), make_sample([2, 3, 4, 8, 9], -1.0, "b")],
        log_ratios=[math.log(3.0), 0.0],
    )
    metrics = update(policy, samples)
    assert metrics["rollout_corr/is_max"] == pytest.approx(3.0, rel=1e-4)  # not C, not a micro-batch mean
    assert metrics["rollout_corr/rollout_is_max"] == metrics["rollout_corr/is_max"]
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(1.0, rel=1e-4)
    # 3 tokens of weight 3, 2 of weight 1, over the batch's 5 loss tokens
    assert metrics["rollout_corr/is_mean"] == pytest.approx((3 * 3.0 + 2 * 1.0) / 5, rel=1e-4)
    assert metrics["rollout_corr/clipped_fraction"] == pytest.approx(3 / 5)
    assert metrics["rollout_corr/kl"] == pytest.approx(-3 * math.log(3.0) / 5, rel=1e-4)


def test_a_mini_batch_without_gradient_takes_no_optimizer_step():
    """After updates that gave Adam momentum, an update whose every advantage is 0 (each
    group's rewards alike) must leave the weights alone: a step on a zero gradient would still
    move them along the momentum."""
    policy = tiny_policy()
    good, bad = [2, 3, 4, 5, 6, 7], [2, 3, 4, 8, 9, 10]
    for _ in range(3):
        update(policy, [make_sample(good, 1.0, "a"), make_sample(bad, -1.0, "b")])
    weights = [p.detach().clone() for p in policy.model.parameters()]
    metrics = update(policy, [make_sample(good, 0.0, "a"), make_sample(bad, 0.0, "b")])
    assert metrics["actor/grad_norm"] == 0.0 and metrics["actor/n_skipped_steps"] >= 1
    assert all(torch.equal(before, after) for before, after in zip(weights, policy.model.parameters()))
    moved = update(policy, [make_sample(good, 1.0, "a"), make_sample(bad, -1.0, "b")])
    assert moved["actor/n_skipped_steps"] == 0
    assert not all(torch.equal(before, after) for before, after in zip(weights, policy.model.parameters()))
