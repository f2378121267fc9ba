import math
from typing import get_args

import pytest

from rollover.training.schedule import SCHEDULES, ScheduleKind, lr_factor, warmup_steps


def test_every_kind_has_one_function() -> None:
    assert set(get_args(ScheduleKind)) == set(SCHEDULES)


@pytest.mark.parametrize(
    ("steps", "ratio", "total", "expected"),
    [
        (5, 0.1, 100, 5),  # explicit steps win over the ratio
        (0, 0.1, 100, 10),  # 0.1 * 100
        (-1, 0.25, 10, 2),  # int(2.5)
        (0, 0.0, 100, 0),
    ],
)
def test_warmup_steps(steps: int, ratio: float, total: int, expected: int) -> None:
    assert warmup_steps(steps, ratio, total) == expected


def test_constant_with_warmup() -> None:
    # warmup 4: step / 4 for steps 0..3, then 1
    factors = [lr_factor(step, warmup=4, total=20, kind="constant") for step in (0, 1, 2, 3, 4, 5, 19)]
    assert factors == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_constant_without_warmup_starts_at_one() -> None:
    assert lr_factor(0, warmup=0, total=20, kind="constant") == 1.0


def test_cosine_with_warmup() -> None:
    # warmup 2, total 10: ramp 0, 1/2; then p = (step - 2) / 8 and ½ + ½ cos(π p)
    def factor(step: int) -> float:
        return lr_factor(step, warmup=2, total=10, kind="cosine")

    assert factor(0) == 0.0
    assert factor(1) == 0.5
    assert factor(2) == pytest.approx(1.0)  # p = 0
    assert factor(4) == pytest.approx(0.5 + 0.5 * math.cos(math.pi / 4))  # p = 1/4: ~0.8536
    assert factor(6) == pytest.approx(0.5)  # p = 1/2
    assert factor(10) == pytest.approx(0.0, abs=1e-12)  # p = 1


def test_cosine_min_lr_ratio() -> None:
    # m = 0.1: ½(1.1) + ½(0.9) cos(π p): p = 0 -> 1, p = 1/2 -> 0.55, p = 1 -> 0.1
    def factor(step: int) -> float:
        return lr_factor(step, warmup=0, total=8, kind="cosine", min_lr_ratio=0.1)

    assert factor(0) == pytest.approx(1.0)
    assert factor(4) == pytest.approx(0.55)
    assert factor(8) == pytest.approx(0.1)
    assert min(factor(step) for step in range(9)) >= 0.1


def test_cosine_num_cycles() -> None:
    # num_cycles 1: cos(2π p) reaches the floor at p = 1/2 and comes back to 1 at p = 1
    def factor(step: int) -> float:
        return lr_factor(step, warmup=0, total=8, kind="cosine", min_lr_ratio=0.2, num_cycles=1.0)

    assert factor(4) == pytest.approx(0.2)
    assert factor(8) == pytest.approx(1.0)


def test_warmup_ratio_feeds_the_schedule() -> None:
    # ratio 0.1 of 50 steps = 5 warmup steps: step 3 is 3/5 of the base lr
    warmup = warmup_steps(0, 0.1, 50)
    assert lr_factor(3, warmup=warmup, total=50, kind="cosine") == pytest.approx(0.6)
    assert lr_factor(5, warmup=warmup, total=50, kind="cosine") == pytest.approx(1.0)


def test_unknown_kind_names_config_key() -> None:
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        lr_factor(0, warmup=0, total=1, kind="linear")  # type: ignore[arg-type]
