from typing import get_args

import pytest
import torch

from rollover.training.loss.aggregate import (
    AGGREGATIONS,
    BatchCounts,
    LossAggMode,
    aggregate,
    local_counts,
    per_rollout_mean,
    rollout_row_divisors,
)

NAN = float("nan")

# 3 rows x 3 tokens; NaN and inf off the mask must never count.
#   row 0: v = 1, 2 on the mask   -> token sum 3, token mean 1.5
#   row 1: v = 4                  -> token sum 4, token mean 4
#   row 2: nothing on the mask    -> not a sequence of the batch
VALUES = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), NAN], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
COUNTS = BatchCounts(n_tokens=3, n_sequences=2, norm_length=4)

EXPECTED: dict[LossAggMode, float] = {
    "token-mean": (1 + 2 + 4) / 3,  # 7/3
    "seq-mean-token-sum": (3 + 4) / 2,  # 3.5
    "seq-mean-token-mean": (1.5 + 4) / 2,  # 2.75
    "seq-mean-token-sum-norm": (3 + 4) / (2 * 4),  # 7/8
}


def test_every_mode_has_one_function() -> None:
    assert set(get_args(LossAggMode)) == set(AGGREGATIONS)
    assert set(EXPECTED) == set(AGGREGATIONS)


def test_local_counts_tokens_and_nonempty_rows() -> None:
    assert local_counts(MASK) == (3.0, 2.0)
    assert local_counts(MASK.bool()) == (3.0, 2.0)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_each_mode_by_hand(mode: LossAggMode) -> None:
    assert aggregate(VALUES, MASK, mode, COUNTS).item() == pytest.approx(EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_micro_batches_sum_to_the_whole_batch(mode: LossAggMode) -> None:
    # Two micro-batches (rows [0] and rows [1, 2]) with the whole batch's counts.
    first = aggregate(VALUES[:1], MASK[:1], mode, COUNTS)
    second = aggregate(VALUES[1:], MASK[1:], mode, COUNTS)
    assert (first + second).item() == pytest.approx(EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_uneven_split_of_a_larger_batch(mode: LossAggMode) -> None:
    # Rows of very different lengths, split unevenly (as ranks and micro-batches split by tokens).
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(7, 5, generator=generator)
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1],
            [1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 1],
            [1, 0, 1, 0, 1],
        ]
    )
    splits = [(0, 1), (1, 4), (4, 7)]
    tokens = sum(local_counts(mask[a:b])[0] for a, b in splits)
    rows = sum(local_counts(mask[a:b])[1] for a, b in splits)
    counts = BatchCounts(n_tokens=tokens, n_sequences=rows, norm_length=5)
    assert (tokens, rows) == local_counts(mask) == (18.0, 6.0)
    whole = aggregate(values, mask, mode, counts)
    parts = sum(aggregate(values[a:b], mask[a:b], mode, counts) for a, b in splits)
    assert isinstance(parts, torch.Tensor)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_token_mean_gradient_is_mask_over_batch_tokens() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    aggregate(values, torch.tensor([[1, 0, 1]]), "token-mean", BatchCounts(4, 1, 1)).backward()
    assert values.grad is not None
    assert values.grad.tolist() == [[0.25, 0.0, 0.25]]


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_zero_counts_give_zero_not_nan(mode: LossAggMode) -> None:
    empty = torch.zeros(2, 3)
    loss = aggregate(torch.full((2, 3), NAN), empty, mode, BatchCounts(0, 0, 0))
    assert loss.item() == 0.0


def test_unknown_mode_names_config_key() -> None:
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(VALUES, MASK, "seq-sum", COUNTS)  # type: ignore[arg-type]


# ---------------------------------------------------------------- per_rollout_mean

# Rollout "a" is split over rows 0 and 1 (2 + 1 = 3 masked tokens), rollout "b" is row 2
# (2 tokens); the batch has R = 3 rows. Divisors: a: 3 * 3 = 9 (rows 0 and 1), b: 2 * 3 = 6.
# loss = (1 + 2) / 9 + 4 / 9 + (3 + 5) / 6 = 7/9 + 4/3 = 19/9:
# each rollout's token mean (a: 7/3, b: 4) weighted 1/R.
ROLLOUT_IDS = ["a", "a", "b"]
ROLLOUT_VALUES = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN], [3.0, 5.0, 100.0]])
ROLLOUT_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]])


def test_rollout_row_divisors_by_hand() -> None:
    assert rollout_row_divisors(ROLLOUT_IDS, [2, 1, 2]) == [9.0, 9.0, 6.0]


def test_rollout_row_divisors_clamp_to_one() -> None:
    assert rollout_row_divisors(["a", "b"], [0, 3]) == [1.0, 6.0]


def test_rollout_row_divisors_length_mismatch() -> None:
    with pytest.raises(ValueError):
        rollout_row_divisors(["a"], [1, 2])


def test_per_rollout_mean_by_hand() -> None:
    row_tokens = ROLLOUT_MASK.sum(dim=-1).tolist()
    divisors = rollout_row_divisors(ROLLOUT_IDS, row_tokens)
    loss = per_rollout_mean(ROLLOUT_VALUES, ROLLOUT_MASK, divisors)
    assert loss.item() == pytest.approx(19 / 9)


def test_per_rollout_mean_micro_batches_sum_to_the_batch() -> None:
    # The rollout "a" straddles the two micro-batches; divisors come from the whole batch.
    divisors = rollout_row_divisors(ROLLOUT_IDS, [2, 1, 2])
    first = per_rollout_mean(ROLLOUT_VALUES[:1], ROLLOUT_MASK[:1], divisors[:1])
    second = per_rollout_mean(ROLLOUT_VALUES[1:], ROLLOUT_MASK[1:], torch.tensor(divisors[1:]))
    assert first.item() == pytest.approx(3 / 9)
    assert (first + second).item() == pytest.approx(19 / 9)


def test_per_rollout_mean_weighs_rollouts_not_rows() -> None:
    # A constant loss of 1 per token: every rollout contributes 1/R whatever its rows and lengths.
    ones = torch.ones(3, 3)
    divisors = rollout_row_divisors(ROLLOUT_IDS, [2, 1, 2])
    row0_1 = per_rollout_mean(ones[:2], ROLLOUT_MASK[:2], divisors[:2])
    row2 = per_rollout_mean(ones[2:], ROLLOUT_MASK[2:], divisors[2:])
    assert row0_1.item() == pytest.approx(1 / 3)
    assert row2.item() == pytest.approx(1 / 3)
