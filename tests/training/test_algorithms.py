import math

import pytest
import torch

from rollover.training.algorithms import (
    compute_advantages,
    ppo_policy_loss,
    rollout_correction_weights,
)

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


# ---------------------------------------------------------------- PPO loss

# One token per branch, ε = 0.2, c = 3:
#   t0: A= 1, r=1.1  -> -A r = -1.1, -A clip(r) = -1.1 -> l = -1.1  (unclipped)
#   t1: A= 1, r=1.5  -> -1.5 vs -1.2                    -> l = -1.2  (clipped)
#   t2: A=-1, r=0.5  ->  0.5 vs  0.8                    -> l =  0.8  (clipped; below cap 3)
#   t3: A=-1, r=5.0  ->  5.0 vs  1.2 -> 5.0, min(5, 3)  -> l =  3.0  (dual-clipped)
#   t4: A= 2, r=0.9  -> -1.8 vs -1.8                    -> l = -1.8  (unclipped)
#   t5: padding (mask 0) full of garbage
# token mean = (-1.1 - 1.2 + 0.8 + 3.0 - 1.8) / 5 = -0.3 / 5 = -0.06
RATIOS = [1.1, 1.5, 0.5, 5.0, 0.9]
ADVS = [1.0, 1.0, -1.0, -1.0, 2.0]


def _ppo_inputs(pad_value: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, pad_value]])
    new = old.clone()
    new[0, :5] += torch.log(torch.tensor(RATIOS))
    new.requires_grad_(True)
    adv = torch.tensor([ADVS + [pad_value]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    return new, old, adv, mask


def test_ppo_dual_clip_branches_by_hand() -> None:
    new, old, adv, mask = _ppo_inputs(0.0)
    loss, metrics = ppo_policy_loss(new, old, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(-0.06, abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(-0.06, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # t1, t2
    assert metrics["actor/pg_clipfrac_dual"] == pytest.approx(1 / 5)  # t3
    # ppo_kl = mean(log π_old - log π_θ) = -ln(1.1 * 1.5 * 0.5 * 5 * 0.9) / 5 = -ln(3.7125) / 5
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(3.7125) / 5, abs=1e-6)

    loss.backward()
    # d(-A r)/d log π_θ = -A r on unclipped tokens, 0 on clipped/dual-clipped, then / 5 tokens:
    # t0: -1.1 / 5 = -0.22, t4: -2 * 0.9 / 5 = -0.36
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([-0.22, 0.0, 0.0, 0.0, -0.36, 0.0], abs=1e-6)


@pytest.mark.parametrize("field", [0, 1, 2])  # which input is dirty: log π_θ, log π_old, A
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -1e30])
def test_ppo_padding_never_affects_loss_or_grad(field: int, garbage: float) -> None:
    clean = _ppo_inputs(0.0)
    dirty = list(_ppo_inputs(0.0))
    with torch.no_grad():
        dirty[field][0, 5] = garbage
    loss_c, _ = ppo_policy_loss(*clean)
    loss_d, metrics_d = ppo_policy_loss(*dirty)
    loss_c.backward()
    loss_d.backward()
    assert loss_d.item() == pytest.approx(loss_c.item())
    assert all(math.isfinite(v) for v in metrics_d.values())
    assert torch.equal(clean[0].grad, dirty[0].grad)  # type: ignore[arg-type]


def test_ppo_is_weights_multiply_per_token_loss() -> None:
    new, old, adv, mask = _ppo_inputs(0.0)
    weights = torch.tensor([[0.5, 1.0, 1.0, 2.0, 1.0, 7.0]])  # padding weight must be ignored
    loss, _ = ppo_policy_loss(new, old, adv, mask, is_weights=weights)
    # (0.5 * -1.1 - 1.2 + 0.8 + 2 * 3.0 - 1.8) / 5 = 3.25 / 5 = 0.65
    assert loss.item() == pytest.approx(0.65, abs=1e-6)


def test_ppo_is_token_mean_over_batch_not_sequence_mean() -> None:
    # r = 1 everywhere, so l = -A. Row 0: one token A = 4; row 1: three tokens A = 1.
    # token mean = (-4 - 1 - 1 - 1) / 4 = -1.75 (a per-sequence mean would give -2.5)
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[4.0, 4.0, 4.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, _ = ppo_policy_loss(lp, lp, adv, mask)
    assert loss.item() == pytest.approx(-1.75)


def test_ppo_all_masked_is_zero_not_nan() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    loss, metrics = ppo_policy_loss(lp, lp.detach(), torch.ones(1, 2), torch.zeros(1, 2))
    assert loss.item() == 0.0
    assert metrics["actor/pg_clipfrac"] == 0.0


# ---------------------------------------------------------------- rollout correction


def test_rollout_correction_off() -> None:
    x = torch.zeros(1, 2)
    assert rollout_correction_weights(x, x, torch.ones(1, 2), None, 2.0) == (None, {})


def test_rollout_correction_bad_mode_names_config_key() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_is"):
        rollout_correction_weights(x, x, torch.ones(1, 2), "tokens", 2.0)  # type: ignore[arg-type]


def test_token_is_weights_clip_and_metrics() -> None:
    # raw weights π_old/μ = [0.5, 1.5, 3, 2.5], C = 2 -> w = [0.5, 1.5, 2, 2]; t4 is masked (NaN μ)
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -1.5, float("nan")]])
    old = behaviour.clone()
    old[0, :4] += torch.log(torch.tensor([0.5, 1.5, 3.0, 2.5]))
    old[0, 4] = -0.3
    old.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights, metrics = rollout_correction_weights(old, behaviour, mask, "token", 2.0)
    assert weights is not None
    assert weights[0].tolist() == pytest.approx([0.5, 1.5, 2.0, 2.0, 0.0], abs=1e-6)
    assert not weights.requires_grad  # stop-gradient
    # Before truncation, as verl reports them: is_max shows how far μ is, not C.
    assert metrics["rollout_corr/is_mean"] == pytest.approx(7.5 / 4)
    assert metrics["rollout_corr/is_max"] == pytest.approx(3.0)
    assert metrics["rollout_corr/clipped_fraction"] == pytest.approx(2 / 4)
    assert metrics["rollout_corr/rollout_is_mean"] == metrics["rollout_corr/is_mean"]
    assert metrics["rollout_corr/rollout_is_max"] == metrics["rollout_corr/is_max"]
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 4)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0  # 0.5 is not below 1/C
    # k1 KL(μ || π_old) = mean(log μ - log π_old) = -ln(0.5 * 1.5 * 3 * 2.5) / 4 = -ln(5.625) / 4
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(5.625) / 4, abs=1e-6)


def test_token_is_weights_clamp_extreme_log_ratios() -> None:
    old = torch.tensor([[100.0, -100.0]])
    behaviour = torch.zeros(1, 2)
    weights, metrics = rollout_correction_weights(old, behaviour, torch.ones(1, 2), "token", 2.0)
    assert weights is not None
    assert weights[0, 0].item() == 2.0
    assert weights[0, 1].item() == pytest.approx(math.exp(-20), rel=1e-5)
    assert all(math.isfinite(v) for v in metrics.values())


def test_is_weights_are_constants_in_the_loss_gradient() -> None:
    # With weights w the gradient wrt log π_θ is w times the unweighted one, and nothing flows
    # back into the log-probs the weights were computed from.
    new, old, adv, mask = _ppo_inputs(0.0)
    old_leaf = old.clone().requires_grad_(True)
    behaviour = old.detach() - torch.tensor([[0.1, -0.2, 0.3, 1.0, -0.4, 0.0]])
    weights, _ = rollout_correction_weights(old_leaf, behaviour, mask, "token", 2.0)
    assert weights is not None and weights.grad_fn is None

    loss_w, _ = ppo_policy_loss(new, old_leaf, adv, mask, is_weights=weights)
    loss_w.backward()
    grad_w = new.grad.clone()  # type: ignore[union-attr]
    new.grad = None
    loss, _ = ppo_policy_loss(new, old_leaf, adv, mask)
    loss.backward()
    assert torch.allclose(grad_w, weights * new.grad)  # type: ignore[operator]
    assert old_leaf.grad is None


def test_sequence_is_weights_per_sample() -> None:
    # row 0 masked log-ratios ln3 + ln0.5 = ln1.5 -> w = 1.5 (masked-out ln100 ignored)
    # row 1 ln2 + ln2 = ln4 -> raw 4 > C = 2 -> w = 2
    # row 2 has no masked token: weight 0, left out of the per-sequence metrics
    log_r = torch.log(torch.tensor([[3.0, 0.5, 100.0], [2.0, 2.0, 1.0], [5.0, 5.0, 5.0]]))
    behaviour = torch.full((3, 3), -1.0)
    old = behaviour + log_r
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    weights, metrics = rollout_correction_weights(old, behaviour, mask, "sequence", 2.0)
    assert weights is not None
    expected = [[1.5, 1.5, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]
    assert weights.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    assert not weights.requires_grad
    assert metrics["rollout_corr/is_mean"] == pytest.approx((1.5 + 4.0) / 2, abs=1e-5)  # before truncation
    assert metrics["rollout_corr/is_max"] == pytest.approx(4.0, abs=1e-5)
    assert metrics["rollout_corr/clipped_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_is_max"] == metrics["rollout_corr/is_max"]
    # kl over the 4 masked tokens: -(ln3 + ln0.5 + ln2 + ln2) / 4 = -ln6 / 4
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(6.0) / 4, abs=1e-6)


def test_sequence_is_weights_clamp_sum() -> None:
    old = torch.tensor([[-15.0, -15.0]])  # Σ = -30 -> clamped to -20
    ones = torch.ones(1, 2)
    weights, _ = rollout_correction_weights(old, torch.zeros(1, 2), ones, "sequence", 2.0)
    assert weights is not None
    assert weights[0, 0].item() == pytest.approx(math.exp(-20), rel=1e-5)
