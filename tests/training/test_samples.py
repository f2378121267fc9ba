import math
from typing import Any

import pytest
import torch

from rollover.training.samples import Sample, build_samples, collate


def _call(prompt: list[int], response: list[int], logprobs: list[float] | None, version: int) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_logprobs": logprobs,
        "policy_version": version,
    }


# Three calls that extend each other: tool outputs [20, 21] and [22] sit between responses.
MULTI_TURN = [
    _call([1, 2, 3], [10, 11], [-0.1, -0.2], 0),
    _call([1, 2, 3, 10, 11, 20, 21], [12], [-0.3], 1),
    _call([1, 2, 3, 10, 11, 20, 21, 12, 22], [13, 14], [-0.4, -0.5], 1),
]


def test_extending_calls_merge_into_one_sample() -> None:
    samples = build_samples("r1", "g1", MULTI_TURN, reward=1.0, max_length=None)
    assert len(samples) == 1
    s = samples[0]
    assert (s.rollout_id, s.group_id, s.reward) == ("r1", "g1", 1.0)
    assert s.input_ids == [1, 2, 3, 10, 11, 20, 21, 12, 22, 13, 14]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert s.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert s.token_versions == [-1, -1, -1, 0, 0, -1, -1, 1, -1, 1, 1]


def test_transition_level_keeps_every_call_its_own_sample() -> None:
    samples = build_samples("r1", "g1", MULTI_TURN, reward=1.0, max_length=None, merge=False)
    assert [s.input_ids for s in samples] == [c["prompt_token_ids"] + c["response_token_ids"] for c in MULTI_TURN]
    assert samples[1].loss_mask == [0] * 7 + [1]


def test_trace_aggregator_sets_the_sample_budget() -> None:
    from rollover.config import load_config
    from rollover.training.settings import SampleBudget

    def budget(*overrides: str) -> tuple[int, bool]:
        config = load_config(None, ["data.max_prompt_length=100", "data.max_response_length=50", *overrides])
        found = SampleBudget.from_config(config)
        return found.max_length, found.merge

    assert budget() == (150, True)
    level = "agentlightning.trace_aggregator"
    assert budget(f"{level}.trajectory_max_prompt_length=1000", f"{level}.trajectory_max_response_length=4000") == (
        5000,
        True,
    )
    assert budget(f"{level}.trajectory_max_response_length=4000", f"{level}.trajectory_max_total_length=2000") == (
        2000,
        True,
    )
    assert budget(f"{level}.level=transition", f"{level}.trajectory_max_response_length=4000") == (150, False)


def test_non_extending_call_starts_new_sample() -> None:
    triplets = MULTI_TURN[:2] + [
        _call([1, 2, 99], [15], [-0.6], 2),  # context was rewritten: not a prefix extension
        _call([1, 2, 99, 15, 23], [16], [-0.7], 2),  # extends the new sample, not the first
        _call([1, 2, 3], [17], [-0.8], 2),  # a retry of the first prompt is shorter: new sample
    ]
    samples = build_samples("r1", "g1", triplets, reward=0.5, max_length=None)
    assert [s.input_ids for s in samples] == [
        [1, 2, 3, 10, 11, 20, 21, 12],
        [1, 2, 99, 15, 23, 16],
        [1, 2, 3, 17],
    ]
    assert samples[1].loss_mask == [0, 0, 0, 1, 0, 1]
    assert samples[1].token_versions == [-1, -1, -1, 2, -1, 2]
    assert all(s.reward == 0.5 for s in samples)


def test_truncation_keeps_lists_aligned_and_drops_empty_samples() -> None:
    [s] = build_samples("r1", "g1", MULTI_TURN, reward=1.0, max_length=8)
    assert s.input_ids == [1, 2, 3, 10, 11, 20, 21, 12]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert len(s.behaviour_logprobs) == len(s.token_versions) == 8
    assert s.behaviour_logprobs[-1] == -0.3

    # The prompt alone fills max_length: nothing left to learn from.
    assert build_samples("r1", "g1", MULTI_TURN[:1], reward=1.0, max_length=3) == []


def test_missing_logprobs_become_nan_on_response_only() -> None:
    [s] = build_samples("r1", "g1", [_call([1, 2], [3, 4], None, 0)], reward=0.0, max_length=None)
    assert s.behaviour_logprobs[:2] == [0.0, 0.0]
    assert all(math.isnan(x) for x in s.behaviour_logprobs[2:])


def test_logprob_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        build_samples("r1", "g1", [_call([1], [3, 4], [-0.1], 0)], reward=0.0, max_length=None)


def test_collate_shapes_padding_and_target_alignment() -> None:
    [long] = build_samples("r1", "g1", MULTI_TURN, reward=1.0, max_length=None)
    [short] = build_samples("r2", "g1", [_call([5, 6], [7, 8], [-1.0, -2.0], 3)], 0.0, None)
    batch = collate([long, short], pad_token_id=0)

    assert batch["input_ids"].shape == (2, 11) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].shape == (2, 11)
    for key in ("loss_mask", "behaviour_logprobs", "token_versions"):
        assert batch[key].shape == (2, 10), key
    assert batch["token_versions"].dtype == torch.long

    assert batch["input_ids"][1].tolist() == [5, 6, 7, 8] + [0] * 7
    assert batch["attention_mask"][1].tolist() == [1] * 4 + [0] * 7

    # Response token j of a sample is predicted at target column j - 1.
    for row, sample in enumerate([long, short]):
        for j, (tok, m) in enumerate(zip(sample.input_ids, sample.loss_mask)):
            if j == 0:
                continue
            assert batch["input_ids"][row, j].item() == tok
            assert batch["loss_mask"][row, j - 1].item() == m
            assert batch["behaviour_logprobs"][row, j - 1].item() == pytest.approx(sample.behaviour_logprobs[j])
            assert batch["token_versions"][row, j - 1].item() == sample.token_versions[j]

    # Concretely: token 10 (input position 3, logprob -0.1) lands in column 2.
    assert batch["behaviour_logprobs"][0, 2].item() == pytest.approx(-0.1)
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert batch["loss_mask"][1, 3:].sum().item() == 0  # padding is never a loss token
    assert batch["token_versions"][1, 3:].tolist() == [-1] * 7


def test_collate_rejects_empty_batch() -> None:
    with pytest.raises(ValueError):
        collate([], pad_token_id=0)


def test_sample_counts_loss_tokens() -> None:
    s = Sample("r", "g", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], reward=1.0)
    assert s.num_loss_tokens == 2 and len(s) == 3


def test_each_choice_of_a_call_is_its_own_sample_and_the_next_call_extends_the_one_it_continues() -> None:
    first = _call([1, 2, 3], [10, 11], [-0.1, -0.2], 0)
    # The agent asked for n=2 on its second turn and carried on from choice 1.
    second = [
        _call([1, 2, 3, 10, 11, 20], [12], [-0.3], 1) | {"choice_index": 0},
        _call([1, 2, 3, 10, 11, 20], [13, 14], [-0.4, -0.5], 1) | {"choice_index": 1},
    ]
    third = _call([1, 2, 3, 10, 11, 20, 13, 14, 21], [15], [-0.6], 1)
    samples = build_samples("r1", "g1", [first, *second, third], reward=1.0, max_length=None)
    assert [s.input_ids for s in samples] == [
        [1, 2, 3, 10, 11, 20, 12],
        [1, 2, 3, 10, 11, 20, 13, 14, 21, 15],
    ]
    # The first turn is trained once, in the first choice's sample; the other choice's sample
    # has it as context.
    assert samples[0].loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert samples[1].behaviour_logprobs[6:] == [-0.4, -0.5, 0.0, -0.6]


def test_a_call_extends_only_a_sample_of_its_own_policy() -> None:
    # A planner and a solver take turns in one conversation, each prompt extending everything
    # before it: each policy's calls merge among themselves, the other's turns as context.
    planner = [
        _call([1, 2, 3], [10, 11], [-0.1, -0.2], 3) | {"policy": "planner"},
        _call([1, 2, 3, 10, 11, 20, 12, 21], [13], [-0.3], 3) | {"policy": "planner"},
    ]
    solver = [
        _call([1, 2, 3, 10, 11, 20], [12], [-0.4], 3) | {"policy": "solver"},
        _call([1, 2, 3, 10, 11, 20, 12, 21, 13, 22], [14], [-0.5], 3) | {"policy": "solver"},
    ]
    calls = [planner[0], solver[0], planner[1], solver[1]]
    samples = build_samples("r1", "g1", calls, reward=1.0, max_length=None)
    assert [(s.policy, s.input_ids) for s in samples] == [
        ("planner", [1, 2, 3, 10, 11, 20, 12, 21, 13]),
        ("solver", [1, 2, 3, 10, 11, 20, 12, 21, 13, 22, 14]),
    ]
    # Each trains on its own responses only: the other policy's are context.
    assert samples[0].loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert samples[1].behaviour_logprobs == [0.0] * 6 + [-0.4, 0.0, 0.0, 0.0, -0.5]
    # Without merging, every call is its own sample of its own policy; a run of one policy has none.
    unmerged = build_samples("r1", "g1", calls, reward=1.0, max_length=None, merge=False)
    assert [s.policy for s in unmerged] == ["planner", "solver", "planner", "solver"]
    assert {s.policy for s in build_samples("r1", "g1", MULTI_TURN, reward=1.0, max_length=None)} == {None}


def test_an_over_long_sample_is_cut_from_the_side_data_truncation_names() -> None:
    call = [_call([1, 2, 3, 4], [10, 11, 12], [-0.1, -0.2, -0.3], 0)]
    right = build_samples("r", "g", call, 1.0, max_length=5)[0]
    left = build_samples("r", "g", call, 1.0, max_length=5, cut="left")[0]
    assert right.input_ids == [1, 2, 3, 4, 10] and right.truncated
    assert left.input_ids == [3, 4, 10, 11, 12] and left.loss_mask == [0, 0, 1, 1, 1] and left.truncated
    assert left.behaviour_logprobs == [0.0, 0.0, -0.1, -0.2, -0.3]
    assert not build_samples("r", "g", call, 1.0, max_length=7)[0].truncated


def test_truncation_error_trains_no_over_long_sample_and_counts_it() -> None:
    import asyncio
    from types import SimpleNamespace

    from rollover.config import load_config
    from rollover.store.models import RolloutState
    from rollover.training.collect import collect_samples
    from rollover.training.manager import TrackedRollout
    from rollover.training.settings import SampleBudget

    calls = {
        "short": [_call([1, 2], [10, 11], [-0.1, -0.2], 0)],
        "long": [_call([1, 2, 3, 4, 5], [10] * 6, [-0.1] * 6, 0)],
    }

    class Client:
        async def triplets(self, rollout_id: str) -> Any:
            return SimpleNamespace(
                reward=1.0, triplets=[SimpleNamespace(model_dump=lambda c=c: c) for c in calls[rollout_id]]
            )

    config = load_config(None, ["data.max_prompt_length=4", "data.max_response_length=4", "data.truncation=error"])
    group = [TrackedRollout(rid, "g", {}, 0, state=RolloutState.SUCCEEDED) for rid in calls]
    budget = SampleBudget.from_config(config)
    batch, metrics = asyncio.run(collect_samples([group], Client().triplets, budget, fill=0.0, policy_version=0))
    assert [s.rollout_id for s in batch.samples] == ["short"]
    assert [r.rollout_id for r in batch.rollouts] == ["short", "long"]  # it still counts in its group's baseline
    assert metrics["training/n_overlong_samples"] == 1
    assert metrics["response_length/max"] == 2 and metrics["prompt_length/mean"] == 2


def test_interleaved_sessions_merge_by_prefix_one_sample_each_nothing_trained_twice() -> None:
    # A harness's main session (A) and a sub-agent or side call (B) alternate: A1, B1, A2, B2.
    a1 = _call([1, 2], [10], [-0.1], 0)
    b1 = _call([5, 6], [50], [-0.5], 0)
    a2 = _call([1, 2, 10, 3], [11], [-0.2], 0)
    b2 = _call([5, 6, 50, 7], [51], [-0.6], 0)
    samples = build_samples("r", "g", [a1, b1, a2, b2], reward=1.0, max_length=None)
    assert [s.input_ids for s in samples] == [[1, 2, 10, 3, 11], [5, 6, 50, 7, 51]]
    trained = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m]
    assert sorted(trained) == [10, 11, 50, 51]  # every response once


def test_a_call_extends_the_longest_sample_its_prompt_starts_with() -> None:
    first = _call([1, 2], [10], [-0.1], 0)
    branch = _call([1, 2, 10, 3], [11], [-0.2], 0)  # extends the first
    longer = _call([1, 2, 10, 3, 11, 4], [12], [-0.3], 0)  # extends the extended one
    samples = build_samples("r", "g", [first, branch, longer], reward=0.0, max_length=None)
    assert [s.input_ids for s in samples] == [[1, 2, 10, 3, 11, 4, 12]]


def test_a_compaction_or_a_branch_starts_a_new_sample() -> None:
    first = _call([1, 2], [10], [-0.1], 0)
    second = _call([1, 2, 10, 3], [11], [-0.2], 0)
    compacted = _call([9, 8], [12], [-0.3], 0)  # the context rewritten (a summary)
    branch = _call([1, 2, 10, 4], [13], [-0.4], 0)  # shares only [1, 2, 10] with the first sample
    samples = build_samples("r", "g", [first, second, compacted, branch], reward=0.0, max_length=None)
    assert [s.input_ids for s in samples] == [[1, 2, 10, 3, 11], [9, 8, 12], [1, 2, 10, 4, 13]]
    # The branch's shared prefix is context again, not trained again.
    assert samples[2].loss_mask == [0, 0, 0, 0, 1]


def test_a_call_with_malformed_version_spans_is_dropped_and_counted_not_raised() -> None:
    import asyncio
    from types import SimpleNamespace

    from rollover.config import load_config
    from rollover.store.models import RolloutState
    from rollover.training.collect import collect_samples
    from rollover.training.manager import TrackedRollout
    from rollover.training.samples import spans_cover_response
    from rollover.training.settings import SampleBudget

    good = _call([1, 2], [10, 11, 12], [-0.1, -0.2, -0.3], 1)
    spanned = {**good, "response_version_spans": [[0, 1], [2, 2]]}
    backwards = {**good, "response_version_spans": [[0, 1], [2, 2], [1, 3]]}
    past_the_end = {**good, "response_version_spans": [[0, 1], [9, 2]]}
    assert spans_cover_response(good) and spans_cover_response(spanned)
    assert not spans_cover_response(backwards) and not spans_cover_response(past_the_end)
    calls = {"ok": [spanned], "bad": [backwards, _call([1, 2, 10, 11, 12, 4], [13], [-0.4], 1)]}

    class Client:
        async def triplets(self, rollout_id: str) -> Any:
            return SimpleNamespace(
                reward=1.0, triplets=[SimpleNamespace(model_dump=lambda c=c: c) for c in calls[rollout_id]]
            )

    budget = SampleBudget.from_config(load_config(None, []))
    group = [TrackedRollout(rid, "g", {}, 0, state=RolloutState.SUCCEEDED) for rid in calls]
    batch, metrics = asyncio.run(collect_samples([group], Client().triplets, budget, fill=0.0, policy_version=1))
    assert metrics["training/n_malformed_calls"] == 1
    trained = {s.rollout_id: [t for t, m in zip(s.input_ids, s.loss_mask) if m] for s in batch.samples}
    assert trained == {"ok": [10, 11, 12], "bad": [13]}  # the malformed call's tokens are not trained
