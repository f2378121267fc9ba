import math
from typing import get_args

import pytest
import torch

from rollover.config.algorithm import RejectionCriterion, RejectionMode, RolloutIsMode
from rollover.training.loss.correction import IS_MODES, importance_weights, rejection_mask

NAN = float("nan")


def test_every_is_mode_is_known() -> None:
    assert set(get_args(RolloutIsMode)) == set(IS_MODES)


def criterion(mode: RejectionMode, upper: float, lower: float | None = None) -> list[RejectionCriterion]:
    """One rejection test before 2026: the ratio within [lower, upper] (lower: 1/upper)."""
    return [RejectionCriterion(mode, 1.0 / upper if lower is None else lower, upper)]


def _logprobs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log π_old, log μ)`` whose ratios π_old/μ are ``ratios`` (NaN = padding: garbage μ)."""
    behaviour = torch.full((len(ratios), len(ratios[0])), -1.0)
    log_r = torch.log(torch.tensor(ratios).nan_to_num(1.0))
    old = behaviour + log_r
    behaviour[torch.tensor(ratios).isnan()] = NAN
    return old, behaviour


# ---------------------------------------------------------------- importance weights


def test_is_bad_mode_names_config_key() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_is"):
        importance_weights(x, x, torch.ones(1, 2), "tokens", 2.0)  # type: ignore[arg-type]


def test_token_is_weights_clip_and_metrics() -> None:
    # raw weights π_old/μ = [0.5, 1.5, 3, 2.5], C = 2 -> w = [0.5, 1.5, 2, 2]; t4 is masked (NaN μ)
    old, behaviour = _logprobs([[0.5, 1.5, 3.0, 2.5, NAN]])
    old.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights, metrics = importance_weights(old, behaviour, mask, "token", 2.0)
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


def test_token_is_fraction_low() -> None:
    # ratios [0.25, 1, 4], C = 2: 0.25 < 1/C -> fraction_low 1/3; 4 > C -> fraction_high 1/3
    old, behaviour = _logprobs([[0.25, 1.0, 4.0]])
    weights, metrics = importance_weights(old, behaviour, torch.ones(1, 3), "token", 2.0)
    assert weights[0].tolist() == pytest.approx([0.25, 1.0, 2.0], abs=1e-6)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_token_is_weights_clamp_extreme_log_ratios() -> None:
    old = torch.tensor([[100.0, -100.0]])
    weights, metrics = importance_weights(old, torch.zeros(1, 2), torch.ones(1, 2), "token", 2.0)
    assert weights[0, 0].item() == 2.0
    assert weights[0, 1].item() == pytest.approx(math.exp(-20), rel=1e-5)
    assert all(math.isfinite(v) for v in metrics.values())


def test_sequence_is_weights_per_sample() -> None:
    # row 0 masked ratios 3 * 0.5 = 1.5 -> w = 1.5 (the masked-out 100 is ignored)
    # row 1 2 * 2 = 4 > C = 2 -> w = 2
    # row 2 has no masked token: weight 0, left out of the per-sequence metrics
    old, behaviour = _logprobs([[3.0, 0.5, 100.0], [2.0, 2.0, 1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    weights, metrics = importance_weights(old, behaviour, mask, "sequence", 2.0)
    expected = [[1.5, 1.5, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]
    assert weights.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    assert metrics["rollout_corr/is_mean"] == pytest.approx((1.5 + 4.0) / 2, abs=1e-5)  # before truncation
    assert metrics["rollout_corr/is_max"] == pytest.approx(4.0, abs=1e-5)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(1.5, abs=1e-5)
    assert metrics["rollout_corr/clipped_fraction"] == pytest.approx(0.5)
    # kl over the 4 masked tokens: -(ln3 + ln0.5 + ln2 + ln2) / 4 = -ln6 / 4
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(6.0) / 4, abs=1e-6)


def test_sequence_is_weights_clamp_sum() -> None:
    old = torch.tensor([[-15.0, -15.0]])  # Σ = -30 -> clamped to -20
    weights, _ = importance_weights(old, torch.zeros(1, 2), torch.ones(1, 2), "sequence", 2.0)
    assert weights[0, 0].item() == pytest.approx(math.exp(-20), rel=1e-5)


def test_is_all_masked_gives_zero_weights_and_finite_metrics() -> None:
    x = torch.full((2, 2), NAN)
    weights, metrics = importance_weights(x, x, torch.zeros(2, 2), "sequence", 2.0)
    assert weights.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert all(v == 0.0 for v in metrics.values())


# ---------------------------------------------------------------- rejection sampling

# Ratios π_old/μ per token (NaN = padding):
#   row 0: [2, 2]        sequence 4,    geometric 2
#   row 1: [0.5, 1.5]    sequence 0.75, geometric √0.75 ~ 0.866
#   row 2: [0.25, 1, 1]  sequence 0.25, geometric 0.25^(1/3) ~ 0.630
#   row 3: nothing masked
# 7 masked tokens in 3 non-empty rows.
RATIOS = [[2.0, 2.0, NAN], [0.5, 1.5, NAN], [0.25, 1.0, 1.0], [NAN, NAN, NAN]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]])


def _reject(
    mode: RejectionMode, upper: float, lower: float | None, veto: float | None = None
) -> tuple[list[list[float]], dict[str, float]]:
    old, behaviour = _logprobs(RATIOS)
    keep, metrics = rejection_mask(old, behaviour, MASK, criterion(mode, upper, lower), veto)
    return keep.tolist(), metrics


def test_token_rejection_default_lower_is_one_over_upper() -> None:
    # upper 2, lower 1/2: only 0.25 is outside (2 is not > 2, 0.5 is not < 0.5)
    keep, metrics = _reject("token", 2.0, None)
    assert keep == [[1, 1, 0], [1, 1, 0], [0, 1, 1], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 7)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_rs_mean"] == pytest.approx((2 + 2 + 0.5 + 1.5 + 0.25 + 1 + 1) / 7)
    assert metrics["rollout_corr/rollout_rs_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_rs_min"] == pytest.approx(0.25)
    assert "rollout_corr/rollout_is_veto_fraction" not in metrics


def test_token_rejection_explicit_lower_bound() -> None:
    # upper 1.8, lower 0.6: the 2s (row 0) and 0.5 and 0.25 go
    keep, metrics = _reject("token", 1.8, 0.6)
    assert keep == [[0, 0, 0], [0, 1, 0], [0, 1, 1], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 7)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(3 / 3)


def test_sequence_rejection() -> None:
    # [lower, upper] = [0.5, 2]: row 0 (4 > 2) and row 2 (0.25 < 0.5) go, row 1 (0.75) stays
    keep, metrics = _reject("sequence", 2.0, None)
    assert keep == [[0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(5 / 7)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    # verl weighs each row by its tokens: rows of 2, 2 and 3 tokens
    assert metrics["rollout_corr/rollout_rs_mean"] == pytest.approx((4 * 2 + 0.75 * 2 + 0.25 * 3) / 7, abs=1e-5)
    assert metrics["rollout_corr/rollout_rs_max"] == pytest.approx(4.0, abs=1e-5)
    assert metrics["rollout_corr/rollout_rs_min"] == pytest.approx(0.25, abs=1e-6)


def test_sequence_rejection_lower_bound_decides() -> None:
    # lower 0.2 instead of 1/2: row 2 (0.25) now stays; row 0 (4 > 2) still goes
    keep, _ = _reject("sequence", 2.0, 0.2)
    assert keep == [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]


def test_geometric_rejection() -> None:
    # [0.5, 2] keeps every row (2, 0.866, 0.630 are all inside)
    keep, metrics = _reject("geometric", 2.0, None)
    assert keep == MASK.float().tolist()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    # [0.7, 1.9] drops row 0 (2 > 1.9) and row 2 (0.630 < 0.7)
    keep, metrics = _reject("geometric", 1.9, 0.7)
    assert keep == [[0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(5 / 7)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    geometric = [2.0, math.sqrt(0.75), 0.25 ** (1 / 3)]
    tokens = [2, 2, 3]
    assert metrics["rollout_corr/rollout_rs_mean"] == pytest.approx(
        sum(g * n for g, n in zip(geometric, tokens)) / 7, abs=1e-5
    )
    assert metrics["rollout_corr/rollout_rs_max"] == pytest.approx(2.0, abs=1e-5)
    assert metrics["rollout_corr/rollout_rs_min"] == pytest.approx(0.25 ** (1 / 3), abs=1e-5)


def test_veto_drops_the_whole_row() -> None:
    # token mode with wide bounds keeps every token; veto 0.3 drops row 2 (its 0.25 < 0.3)
    keep, metrics = _reject("token", 10.0, 0.1, veto=0.3)
    assert keep == [[1, 1, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 3)
    # verl reports the rejection's own fractions before the veto: the bounds dropped nothing
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0


def test_veto_uses_the_unclamped_ratio() -> None:
    # ρ = -30: the clamped ratio e^-20 ~ 2e-9 is above the veto 1e-10, the true e^-30 ~ 9e-14 is not.
    # Sequence bounds [e^-40, e^40] would keep the row on their own.
    old = torch.tensor([[-30.0, 0.0], [0.0, 0.0]])
    bounds = math.exp(40.0)
    keep, metrics = rejection_mask(
        old, torch.zeros(2, 2), torch.ones(2, 2), criterion("sequence", bounds, 1 / bounds), 1e-10
    )
    assert keep.tolist() == [[0, 0], [1, 1]]
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(0.5)


def test_rejection_bad_arguments() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="criterion"):
        rejection_mask(x, x, torch.ones(1, 2), [])
    with pytest.raises(ValueError, match="veto"):
        rejection_mask(x, x, torch.ones(1, 2), criterion("token", 2.0), veto=0.0)


def test_rejection_keep_is_a_constant() -> None:
    old, behaviour = _logprobs(RATIOS)
    old.requires_grad_(True)
    keep, _ = rejection_mask(old, behaviour, MASK, criterion("token", 2.0))
    assert keep.dtype == torch.float32
    assert not keep.requires_grad
