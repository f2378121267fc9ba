"""The gsm8k example: the answer verifier, the data, and 2 training steps through the system."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from examples.gsm8k import prepare as gsm_prepare
from examples.gsm8k.task import (
    EASY_TEMPLATES,
    PROSE_ANSWER,
    answers_match,
    demonstration,
    extract_answer,
    make_splits,
    parse_answer,
    parse_number,
    score,
)
from examples.heldout import heldout_rewards, paired_difference
from rollover.config import load_config
from rollover.training.data import read_tasks, write_tasks
from tests.runs import train_briefly

GSM_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gsm8k" / "config.yaml"


# -- the verifier -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("-17", -17),
        ("+5", 5),
        ("1,234", 1234),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("$1,200", 1200),
        ("$ 3.50", Fraction(7, 2)),
        ("-$5", -5),
        ("50%", 50),
        ("12.5 %", Fraction(25, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3 / 4", Fraction(-3, 4)),
        ("1 1/2", Fraction(3, 2)),
        ("0.75", Fraction(3, 4)),
        (".5", Fraction(1, 2)),
        ("12.", 12),
        ("18 dollars.", 18),
        ("\u22127", -7),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\$40", 40),
        ("1.5e3", 1500),
        ("The answer is 9 apples", 9),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "none", "x/y", "7/0", "$"])
def test_parse_number_none(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("$1,200.", 1200),
        ("42 (42 apples)", 42),
        ("18 dollars per day", 18),
        ("1 1/2 cups", Fraction(3, 2)),
        ("2 * 2 = 4", None),  # an expression, not an answer
        ("50% of 80", None),
        ("3-4", None),
        ("none", None),
    ],
)
def test_parse_answer(text, value):
    assert parse_answer(text) == value


@pytest.mark.parametrize(
    "reply, answer",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,200.", "1,200."),
        ("ANSWER: $18", "$18"),
        ("Answer: 3/4", "3/4"),
        ("first #### 5\nthen #### 6", "6"),
        ("#### none\nanswer: 12", "12"),  # the last marker followed by a number
        ("so it is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("The total is 12 apples.", None),  # no marker: no final answer
        ("####", None),
    ],
)
def test_extract_answer(reply, answer):
    assert extract_answer(reply) == answer


@pytest.mark.parametrize(
    "predicted, gold, same",
    [
        ("0.75", "3/4", True),
        ("2.50", "2.5", True),
        ("$1,000", "1000", True),
        ("50%", "50", True),
        ("0.30000000000000004", "0.3", True),
        ("-4", "-4", True),
        ("10001", "10000", False),
        ("4", "-4", False),
        ("0.33", "1/3", False),
        (None, "3", False),
        ("abc", "3", False),
    ],
)
def test_answers_match(predicted, gold, same):
    assert answers_match(predicted, gold) is same


def test_score():
    task = {"answer": "288"}
    assert score(task, "105 + 55 = 160, 160 + 128 = 288\n#### 288") == 1.0
    assert score(task, "#### 288.0") == 1.0
    assert score(task, "#### 287") == 0.0
    assert score(task, "the answer is 288") == 0.0  # the protocol's marker is required
    assert score({"answer": "2"}, "#### 2 * 2 = 4") == 0.0  # its first number is not its answer
    assert score({"answer": "4"}, "#### 2 * 2 = 4") == 0.0


# -- the data -------------------------------------------------------------------------------------


def test_task_generation_is_deterministic_and_split():
    train, val = make_splits(30, 10, seed=3)
    again_train, again_val = make_splits(30, 10, seed=3)
    assert (train, val) == (again_train, again_val)
    assert len(train) == 30 and len(val) == 10
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    assert len({t["id"] for t in train + val}) == 40
    for task in train + val:
        assert parse_number(task["answer"]) is not None and task["question"]
    other, _ = make_splits(30, 10, seed=4)
    assert [t["question"] for t in other] != [t["question"] for t in train]


def test_easy_templates_and_demonstrations():
    train, val = make_splits(20, 5, seed=3, templates=EASY_TEMPLATES)
    assert (train, val) == make_splits(20, 5, seed=3, templates=EASY_TEMPLATES)
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    for task in train + val:
        reply = demonstration(task)[-1]["content"]
        assert score(task, reply) == 1.0 and reply.count("####") == 1 and "=" in reply  # worked, then marked
        prose = demonstration(task, PROSE_ANSWER)[-1]["content"]
        assert score(task, prose) == 0.0 and prose.endswith(f"The answer is {task['answer']}.")


def test_heldout_paired_difference(tmp_path):
    import asyncio

    from rollover.store.models import EventCreate, RolloutCreate, RolloutState, StatusFields
    from rollover.store.sqlite import RolloutStore

    before, after = [0, 1, 0, 0], [1, 1, 0, 1]

    async def write() -> None:
        store = RolloutStore(tmp_path / "store.db")
        try:
            finished = [
                (f"r-{step}-{i}", step, i, reward)
                for step, rw in ((0, before), (5, after))
                for i, reward in enumerate(rw)
            ]
            # An evaluation under way (step 9): its unfinished rollouts are left out, not counted as 0.
            unfinished = [("u0", 9, 0, RolloutState.RUNNING), ("u1", 9, 1, RolloutState.QUEUING)]
            items = [
                RolloutCreate(rollout_id=rid, is_train=False, metadata={"data_id": f"val-{step}-{i}"})
                for rid, step, i, _ in [*finished, *unfinished]
            ]
            await store.add_rollouts([*items, RolloutCreate(rollout_id="t", metadata={"data_id": "train-1"})])
            for rid, _, _, reward in finished:
                await store.update_status(rid, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
                await store.add_event(rid, "a1", EventCreate(event_type="reward", data={"value": reward}))
                state = RolloutState.FAILED if reward == 0 else RolloutState.SUCCEEDED
                await store.update_status(rid, StatusFields(state=state))
            for rid, _, _, state in unfinished:
                if state is RolloutState.RUNNING:
                    await store.update_status(rid, StatusFields(state=state, last_attempt_id="a1"))
        finally:
            store.close()

    asyncio.run(write())
    steps = heldout_rewards(tmp_path)
    assert steps == {0: dict(enumerate(map(float, before))), 5: dict(enumerate(map(float, after)))}  # no step 9
    r = paired_difference(steps[0], steps[5])
    assert (r["n"], r["before"], r["after"], r["diff"]) == (4, 0.25, 0.75, 0.5)
    assert r["se"] == pytest.approx((1 / 3) ** 0.5 / 2)  # diffs 1,0,0,1: sd sqrt(1/3), n 4


def test_prepare_writes_cached_data(tmp_path, monkeypatch):
    monkeypatch.setattr(gsm_prepare, "TRAIN_SIZE", 12)
    monkeypatch.setattr(gsm_prepare, "VAL_SIZE", 4)
    config = load_config(
        GSM_CONFIG, [f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.model.path=/some/model"]
    )
    config = gsm_prepare.prepare(config)
    assert len(read_tasks(config.data.train_files)) == 12 and len(read_tasks(config.data.val_files)) == 4
    assert Path(config.data.train_files).parent == tmp_path / "_cache" / "gsm8k"
    assert config.actor_rollout_ref.model.path == "/some/model"
    assert config.agentlightning.async_rollout.async_train_batch_size == 2 * config.data.train_batch_size


# -- 2 training steps through the real system -------------------------------------------------


@pytest.mark.vllm
def test_gsm8k_training_smoke(tmp_path, calc_model, vllm_engine):
    """The tiny calc model knows nothing of GSM: rewards are ~0; the point is that the whole
    loop runs, every agent reports a reward, and the async metrics are written."""
    train, val = make_splits(40, 8, seed=5)
    short = [t for t in train if len(t["question"]) < 260]  # fits the test engine's 512 tokens
    write_tasks(tmp_path / "train.jsonl", short)
    write_tasks(tmp_path / "val.jsonl", [t for t in val if len(t["question"]) < 260][:2] or short[:2])
    train_rows, val_rows = train_briefly(
        GSM_CONFIG,
        tmp_path,
        calc_model,
        "gsm8k-smoke",
        2,
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'val.jsonl'}",
        "data.val_batch_size=2",
        "data.train_batch_size=2",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "agentlightning.local.env.ROLLOVER_GSM_MAX_TOKENS='16'",
        engine=vllm_engine,
    )
    for row in train_rows:
        assert row["training/async/n_completed_rollouts"] == 2 * 4
        assert row["rollouts/n_failed"] == 0 and row["rollouts/n_missing_reward"] == 0
        assert 0.0 <= row["critic/score/mean"] <= 1.0
    assert val_rows and all(r["val/n_failed"] == 0 for r in val_rows)
