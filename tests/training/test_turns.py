"""Credit per turn: the turns a sample keeps (merged, cut), `turn_return`'s advantages pinned to
hand-computed values, and its place in the update's preparation and metrics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollover.config import ConfigError, load_config
from rollover.training.advantages import GroupKey, Unit, UnitScore, outcome_advantages
from rollover.training.prepare import Recomputed, prepare_update
from rollover.training.samples import RolloutScore, Sample, Turn, build_samples
from rollover.training.turns import (
    discounted_returns,
    turn_metrics,
    turn_return_advantages,
    turn_token_advantages,
)
from rollover.training.update_settings import UpdateSettings


def call(prompt: list[int], response: list[int], reward: float | None = None) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_logprobs": [-0.5] * len(response),
        "policy_version": 0,
        "reward": reward,
    }


def three_turns(rewards: tuple[float | None, float | None, float | None]) -> list[dict[str, Any]]:
    """Three calls that merge into one sample: prompt 2 tokens, responses of 2, 1 and 3 tokens
    with a tool result of 1 token before each later call."""
    first = call([1, 2], [10, 11], rewards[0])
    second = call([1, 2, 10, 11, 20], [12], rewards[1])
    third = call([1, 2, 10, 11, 20, 12, 21], [13, 14, 15], rewards[2])
    return [first, second, third]


def test_a_merged_sample_keeps_each_calls_last_token_order_and_reward() -> None:
    [sample] = build_samples("r", "g", three_turns((0.5, None, 2.0)), 1.0, None)
    assert sample.input_ids == [1, 2, 10, 11, 20, 12, 21, 13, 14, 15]
    assert sample.turns == (Turn(3, 0, 0.5), Turn(5, 1, None), Turn(9, 2, 2.0))
    unmerged = build_samples("r", "g", three_turns((0.5, None, 2.0)), 1.0, None, merge=False)
    assert [s.turns for s in unmerged] == [(Turn(3, 0, 0.5),), (Turn(5, 1, None),), (Turn(9, 2, 2.0),)]


def test_a_cut_sample_keeps_the_turns_of_the_tokens_it_keeps() -> None:
    [right] = build_samples("r", "g", three_turns((0.5, None, 2.0)), 1.0, 5)  # keeps [1 2 10 11 20]
    # the second call's response is cut off: its turn ends at the last token kept (context, so
    # untrained), and the third's is gone
    assert right.turns == (Turn(3, 0, 0.5), Turn(4, 1, None))
    [right] = build_samples("r", "g", three_turns((0.5, None, 2.0)), 1.0, 8)  # ... 21 13: the last call cut
    assert right.turns == (Turn(3, 0, 0.5), Turn(5, 1, None), Turn(7, 2, 2.0))
    [left] = build_samples("r", "g", three_turns((0.5, None, 2.0)), 1.0, 6, cut="left")  # the last 6 tokens
    assert left.input_ids == [20, 12, 21, 13, 14, 15]
    assert left.turns == (Turn(1, 1, None), Turn(5, 2, 2.0))


def test_discounted_returns() -> None:
    # G2 = 2; G1 = 0 + 0.5 * 2 = 1; G0 = 1 + 0.5 * 1 = 1.5
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert discounted_returns([], 0.9) == []


def test_turn_return_subtracts_the_other_units_whole_returns() -> None:
    groups = {Unit("a"): GroupKey("g"), Unit("b"): GroupKey("g"), Unit("c"): GroupKey("g"), Unit("d"): GroupKey("h")}
    rewards = {Unit("a"): [1.0, 0.0, 2.0], Unit("b"): [0.0, 1.0], Unit("c"): [3.0], Unit("d"): [0.25, 0.5]}
    adv = turn_return_advantages(rewards, groups, 0.5)
    # whole returns: a 1.5, b 0.5, c 3; baselines: a (0.5 + 3) / 2, b (1.5 + 3) / 2, c (1.5 + 0.5) / 2
    assert adv[Unit("a")] == pytest.approx([1.5 - 1.75, 1.0 - 1.75, 2.0 - 1.75])
    assert adv[Unit("b")] == pytest.approx([0.5 - 2.25, 1.0 - 2.25])
    assert adv[Unit("c")] == pytest.approx([3.0 - 1.0])
    assert adv[Unit("d")] == pytest.approx([0.5, 0.5])  # a group of one keeps its returns (0.25 + 0.5 * 0.5)


def test_one_terminal_reward_gives_every_token_rloos_advantage() -> None:
    scores = [UnitScore(Unit(r), GroupKey("g"), v) for r, v in (("a", 1.0), ("b", 0.0), ("c", 0.5))]
    samples = [build_samples(u.unit.rollout_id, "g", three_turns((None, None, None)), u.score, None)[0] for u in scores]
    units = [u.unit for u in scores]
    trained = [torch.tensor(s.loss_mask[1:], dtype=torch.float32) for s in samples]
    score_of, group_of = {u.unit: u.score for u in scores}, {u.unit: u.group for u in scores}
    advantages = turn_token_advantages(samples, units, trained, score_of, group_of, 1.0)
    for advantage, rloo, mask in zip(advantages, outcome_advantages(scores, "rloo"), trained):
        assert torch.allclose(advantage, rloo * mask)


def test_turn_rewards_reach_only_their_turns_tokens() -> None:
    """Two rollouts of one group, three turns each (γ = 1): a's turn rewards 0.5, -, 2 and outcome
    1; b's none and outcome 0. Returns a: 3.5, 3, 3 (the outcome on the last turn); b: 0, 0, 0."""
    a = build_samples("a", "g", three_turns((0.5, None, 2.0)), 1.0, None)[0]
    b = build_samples("b", "g", three_turns((None, None, None)), 0.0, None)[0]
    trained = [torch.tensor(s.loss_mask[1:], dtype=torch.float32) for s in (a, b)]
    units = [Unit("a"), Unit("b")]
    score_of = {Unit("a"): 1.0, Unit("b"): 0.0}
    group_of = dict.fromkeys(units, GroupKey("g"))
    adv_a, adv_b = turn_token_advantages([a, b], units, trained, score_of, group_of, 1.0)
    # target t predicts input t + 1: turn 0 is targets 0..2 (tokens 10 11), turn 1 targets 3..4
    # (the tool token 20 is context, then 12), turn 2 targets 5..8 (21 context, then 13 14 15)
    assert adv_a.tolist() == pytest.approx([0, 3.5, 3.5, 0, 3.0, 0, 3.0, 3.0, 3.0])
    assert adv_b.tolist() == pytest.approx([0, -3.5, -3.5, 0, -3.5, 0, -3.5, -3.5, -3.5])


def settings(*overrides: str) -> UpdateSettings:
    return UpdateSettings.from_config(load_config(None, list(overrides)))


def test_the_update_prepares_turn_credit_and_reports_it() -> None:
    a = build_samples("a", "g", three_turns((0.5, None, 2.0)), 1.0, None)[0]
    b = build_samples("b", "g", three_turns((None, None, None)), 0.0, None)[0]
    rollouts = [RolloutScore("a", "g", 1.0), RolloutScore("b", "g", 0.0)]
    recomputed = [Recomputed(torch.tensor(s.behaviour_logprobs[1:])) for s in (a, b)]
    turn = prepare_update([a, b], rollouts, recomputed, settings("algorithm.adv_estimator=turn_return"))
    assert turn.rows[0].advantages.tolist() == pytest.approx([0, 3.5, 3.5, 0, 3.0, 0, 3.0, 3.0, 3.0])
    metrics = turn.metrics
    assert metrics["training/turns_per_sample"] == 3.0
    assert (metrics["critic/turn_rewards/mean"], metrics["critic/turn_rewards/max"]) == (1.25, 2.0)
    assert metrics["critic/advantages/within_sample_std"] > 0
    # against the outcome alone (a +1, b -1 on every token): a's and b's tokens all differ
    assert metrics["critic/advantages/differs_from_outcome_fraction"] == 1.0
    grpo = prepare_update([a, b], rollouts, recomputed, settings())  # outcome estimators ignore turn rewards
    assert grpo.metrics["critic/advantages/within_sample_std"] == pytest.approx(0.0, abs=1e-6)
    assert "critic/advantages/differs_from_outcome_fraction" not in grpo.metrics


def test_a_sample_built_by_hand_is_one_turn() -> None:
    sample = Sample("a", "g", [1, 2, 3, 4], [0, 1, 1, 1], [0.0] * 4, [0] * 4, 1.0)
    other = Sample("b", "g", [1, 2, 3], [0, 1, 1], [0.0] * 3, [0] * 3, 0.0)
    trained = [torch.tensor(s.loss_mask[1:], dtype=torch.float32) for s in (sample, other)]
    units = [Unit("a"), Unit("b")]
    adv = turn_token_advantages(
        [sample, other], units, trained, {Unit("a"): 1.0, Unit("b"): 0.0}, dict.fromkeys(units, GroupKey("g")), 0.9
    )
    assert adv[0].tolist() == pytest.approx([1.0, 1.0, 1.0]) and adv[1].tolist() == pytest.approx([-1.0, -1.0])
    assert turn_metrics([sample]) == {"training/turns_per_sample": 0.0}


def test_gamma_is_a_discount() -> None:
    assert settings("algorithm.gamma=0.9").gamma == 0.9
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        load_config(None, ["algorithm.gamma=1.5"])
