import math

import pytest
import torch

from rollover.training.advantages import compute_advantages, penalised_scores
from rollover.training.samples import RolloutScore

# ---------------------------------------------------------------- advantages


def test_grpo_two_interleaved_groups() -> None:
    # group a = [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = sqrt(1/3)
    # group b = [2, 4, 9]:    mean 5,   unbiased var = (9 + 1 + 16) / 2 = 13, std = sqrt(13)
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 9.0, 1.0])
    groups = ["a", "b", "a", "b", "a", "b", "a"]
    adv = compute_advantages(rewards, groups, "grpo")
    sa = math.sqrt(1 / 3) + 1e-6
    sb = math.sqrt(13) + 1e-6
    expected = [0.5 / sa, -3 / sb, -0.5 / sa, -1 / sb, -0.5 / sa, 4 / sb, 0.5 / sa]
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[0].item() == pytest.approx(0.866025, abs=1e-5)


def test_rloo_hand_values() -> None:
    # a: 4/3 * (±0.5) = ±2/3 (= s minus the mean of the other three, e.g. 1 - 1/3)
    # b: 3/2 * (-3, -1, 4) = (-4.5, -1.5, 6)   (e.g. 2 - (4 + 9) / 2 = -4.5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 9.0])
    groups = ["a"] * 4 + ["b"] * 3
    adv = compute_advantages(rewards, groups, "rloo")
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4.5, -1.5, 6.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_singleton_group_keeps_raw_reward(estimator: str) -> None:
    rewards = torch.tensor([0.7, 1.0, 0.0])
    groups = ["solo", "pair", "pair"]
    adv = compute_advantages(rewards, groups, estimator)  # type: ignore[arg-type]
    assert adv[0].item() == pytest.approx(0.7)
    assert torch.isfinite(adv).all()


def test_grpo_constant_group_is_zero() -> None:
    adv = compute_advantages(torch.tensor([1.0, 1.0, 1.0]), ["g"] * 3, "grpo")
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_unknown_estimator_names_config_key() -> None:
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        compute_advantages(torch.tensor([1.0]), ["g"], "ppo")  # type: ignore[arg-type]


def test_rewards_group_ids_length_mismatch() -> None:
    with pytest.raises(ValueError):
        compute_advantages(torch.tensor([1.0, 2.0]), ["g"], "grpo")


def test_dr_grpo_centres_without_dividing_by_the_std() -> None:
    # algorithm.norm_adv_by_std_in_grpo=false: group a = [1, 0, 0, 1] -> ±0.5, b = [2, 4, 9] -> (-3, -1, 4)
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 9.0, 1.0])
    groups = ["a", "b", "a", "b", "a", "b", "a"]
    adv = compute_advantages(rewards, groups, "grpo", norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, -3.0, -0.5, -1.0, -0.5, 4.0, 0.5])


def test_kl_in_the_reward_subtracts_the_coefficient_times_the_rollouts_kl() -> None:
    rollouts = [RolloutScore("r1", "g", 1.0), RolloutScore("r2", "g", 0.0), RolloutScore("r3", "g", 1.0)]
    # r3 has no samples (no recorded calls): it keeps its reward
    assert penalised_scores(rollouts, {"r1": 2.0, "r2": 0.5}, 0.1) == pytest.approx([0.8, -0.05, 1.0])
