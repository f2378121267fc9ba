"""One PPO update on a real (tiny) transformer moves probability toward rewarded responses."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollover.config import load_config
from rollover.training.policy import Policy
from rollover.training.samples import Sample


class _Tok:
    pad_token_id = 0
    eos_token_id = 1


def tiny_policy(overrides=()):
    torch.manual_seed(0)
    config = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-2", "trainer.device=cpu", *overrides])
    policy = Policy.__new__(Policy)
    policy.config = config
    policy.device = torch.device("cpu")
    policy.tokenizer = _Tok()
    policy.pad_token_id = 0
    policy.model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    )
    policy.optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2, weight_decay=0.0)
    return policy


def sequence_logprob(policy, ids):
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return sum(logits[t, ids[t + 1]].item() for t in range(2, len(ids) - 1))


def make_sample(ids, advantage, rid):
    mask = [0, 0, 0] + [1] * (len(ids) - 3)
    return Sample(rid, "g", ids, mask, [0.0] * len(ids), [0] * len(ids), reward=0.0, advantage=advantage)


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
        metrics = policy.update(samples, random.Random(0))
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
    policy.update([make_sample(ids, 0.0, "a")], random.Random(0))
    assert sequence_logprob(policy, ids) == pytest.approx(before, abs=1e-6)
