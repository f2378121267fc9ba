import math
from typing import get_args

import pytest
import torch

from rollover.training.loss.kl import (
    KL_ESTIMATORS,
    KLBase,
    KLType,
    adaptive_kl_coef,
    fixed_kl_coef,
    kl_estimate,
)

# log p - log p_ref = d = [1, -1, 0]
LOGP = [[-1.0, -2.0, 0.5]]
REF = [[-2.0, -1.0, 0.5]]
E = math.e

# k3 with x = log p_ref - log p = [-1, 1, 0]: e^x - x - 1 = [e^-1, e - 2, 0]
EXPECTED: dict[KLBase, list[float]] = {
    "kl": [1.0, -1.0, 0.0],
    "k1": [1.0, -1.0, 0.0],
    "abs": [1.0, 1.0, 0.0],
    "mse": [0.5, 0.5, 0.0],  # ½ d²
    "k2": [0.5, 0.5, 0.0],
    "low_var_kl": [1 / E, E - 2, 0.0],
    "k3": [1 / E, E - 2, 0.0],
}
# d/d log p of each estimator: k1: 1; abs: sign(d); k2: d; k3: 1 - e^x = [1 - 1/e, 1 - e, 0]
K2_GRAD = [1.0, -1.0, 0.0]


def _estimate_and_grad(kind: KLType) -> tuple[list[float], list[float]]:
    logp = torch.tensor(LOGP, requires_grad=True)
    value = kl_estimate(logp, torch.tensor(REF), kind)
    value.sum().backward()
    assert logp.grad is not None
    return value[0].tolist(), logp.grad[0].tolist()


def test_every_kl_name_has_a_base_estimator() -> None:
    assert set(get_args(KLBase)) == set(KL_ESTIMATORS)
    assert {name.removesuffix("+") for name in get_args(KLType)} == set(KL_ESTIMATORS)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_estimators_by_hand(kind: KLBase) -> None:
    value, _ = _estimate_and_grad(kind)
    assert value == pytest.approx(EXPECTED[kind], abs=1e-6)


def test_k3_gradient_is_its_own() -> None:
    _, grad = _estimate_and_grad("k3")
    assert grad == pytest.approx([1 - 1 / E, 1 - E, 0.0], abs=1e-6)


@pytest.mark.parametrize("kind", ["kl+", "k1+", "abs+", "low_var_kl+", "k3+"])
def test_straight_through_value_of_base_gradient_of_k2(kind: KLType) -> None:
    value, grad = _estimate_and_grad(kind)
    base_value, base_grad = _estimate_and_grad(kind.removesuffix("+"))  # type: ignore[arg-type]
    assert value == pytest.approx(base_value, abs=1e-6)
    assert grad == pytest.approx(K2_GRAD, abs=1e-6)


def test_k3_plus_gradient_differs_from_k3() -> None:
    # The point of the variant: k3's gradient (1 - e^x) is not the KL's gradient (d).
    _, grad = _estimate_and_grad("k3+")
    _, own = _estimate_and_grad("k3")
    assert grad != pytest.approx(own, abs=1e-3)


def test_k3_is_bounded() -> None:
    # d = -30 -> x = 30, clamped to 20 -> e^20 - 21, clamped to 10
    # d = 30  -> x = -30, clamped to -20 -> e^-20 + 19 ~ 19, clamped to 10
    value = kl_estimate(torch.tensor([[-30.0, 30.0]]), torch.zeros(1, 2), "k3")
    assert value.tolist() == [[10.0, 10.0]]


@pytest.mark.parametrize("kind", get_args(KLType))
def test_mask_zeroes_padding_and_keeps_gradient_finite(kind: KLType) -> None:
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-2.0, float("inf")]])
    value = kl_estimate(logp, ref, kind, mask=torch.tensor([[1, 0]]))
    value.sum().backward()
    assert value[0, 1].item() == 0.0
    assert math.isfinite(value[0, 0].item())
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_unknown_kind_raises() -> None:
    with pytest.raises(ValueError, match="kl_penalty"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k2+")  # type: ignore[arg-type]


# ---------------------------------------------------------------- controllers


def test_fixed_controller_keeps_coef() -> None:
    assert fixed_kl_coef(0.05) == 0.05


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        (1.1, 0.1 * (1 + 0.1 * 10 / 100)),  # error 0.1 -> up 1%: 0.101
        (5.0, 0.1 * (1 + 0.2 * 10 / 100)),  # error 4 capped at 0.2 -> up 2%: 0.102
        (0.95, 0.1 * (1 - 0.05 * 10 / 100)),  # error -0.05 -> down 0.5%: 0.0995
        (0.0, 0.1 * (1 - 0.2 * 10 / 100)),  # error -1 capped at -0.2 -> down 2%: 0.098
        (1.0, 0.1),  # on target: unchanged
    ],
)
def test_adaptive_controller_by_hand(current_kl: float, expected: float) -> None:
    coef = adaptive_kl_coef(0.1, current_kl=current_kl, n_steps=10, target_kl=1.0, horizon=100)
    assert coef == pytest.approx(expected)


def test_adaptive_controller_moves_towards_target() -> None:
    above = adaptive_kl_coef(0.1, current_kl=0.3, n_steps=1, target_kl=0.2, horizon=10)
    below = adaptive_kl_coef(0.1, current_kl=0.1, n_steps=1, target_kl=0.2, horizon=10)
    assert above > 0.1 > below
    assert above == pytest.approx(0.1 * 1.02)  # error 0.5 capped at 0.2, times 1/10
    assert below == pytest.approx(0.1 * 0.98)  # error -0.5 capped at -0.2
