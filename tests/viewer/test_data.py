"""What the viewer reads from a run folder, checked against the trainer's own code."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time

import pytest

from rollover.store import EventCreate, RolloutCreate, RolloutState, RolloutStore, StatusFields, StoreError
from rollover.training.samples import build_samples
from rollover.viewer.data import RolloutFilter, RunFolder, RunFolderError
from tests.viewer.runfolder import call_event, ids, write_run


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def folder(tmp_path):
    run_dir = write_run(tmp_path / "run")
    folder = RunFolder(run_dir)
    yield folder
    folder.close()


def by_id(rows):
    return {r["rollout_id"]: r for r in rows}


def test_rollouts_carry_rewards_and_the_trainers_advantages(folder):
    rows = by_id(run(folder.rollouts()))
    assert set(rows) == {"r-g0-0", "r-g0-1", "r-g1-0", "r-g1-1", "val-0-0"}
    assert rows["r-g0-0"]["reward"] == 1.0 and rows["r-g0-1"]["reward"] == 0.0
    # GRPO on (1, 0): (s - 0.5) / (std 0.7071 + 1e-6)
    assert rows["r-g0-0"]["advantage"] == pytest.approx(0.7071, abs=1e-3)
    assert rows["r-g0-1"]["advantage"] == pytest.approx(-0.7071, abs=1e-3)
    # an aborted group was never trained; held-out rollouts have no advantage
    assert rows["r-g1-0"]["advantage"] is None and rows["r-g1-1"]["aborted"]
    assert rows["val-0-0"]["mode"] == "val" and rows["val-0-0"]["advantage"] is None
    assert rows["r-g0-1"]["n_attempts"] == 2


@pytest.mark.parametrize(
    "keep,expected",
    [
        (RolloutFilter(step=1), {"r-g0-0", "r-g0-1"}),  # enqueued_step 0: by the first step
        (RolloutFilter(step=2), {"r-g1-0", "r-g1-1"}),
        (RolloutFilter(step=0), {"val-0-0"}),  # held out before training
        (RolloutFilter(state="aborted"), {"r-g1-1"}),
        (RolloutFilter(state="failed"), {"r-g1-1"}),
        (RolloutFilter(state="succeeded", mode="train"), {"r-g0-0", "r-g0-1", "r-g1-0"}),
        (RolloutFilter(mode="val"), {"val-0-0"}),
        (RolloutFilter(group="g0"), {"r-g0-0", "r-g0-1"}),
        (RolloutFilter(reward_min=0.5), {"r-g0-0", "r-g1-0", "val-0-0"}),
        (RolloutFilter(reward_max=0.5), {"r-g0-1"}),
    ],
)
def test_filters(folder, keep, expected):
    assert {r["rollout_id"] for r in run(folder.rollouts(keep))} == expected


def test_one_rollout_shows_attempts_calls_and_the_trained_sequence(folder):
    detail = run(folder.rollout("r-g0-0"))
    assert [c["response_message"]["content"] for c in detail["calls"]] == ["CALL calc(2+3)", "ANSWER: 5 <eos>"]
    assert [m["role"] for m in detail["calls"][1]["messages"]] == ["user", "assistant", "tool"]
    assert [e["event_type"] for e in detail["events"]] == ["reward"]
    assert [s["rollout_id"] for s in detail["siblings"]] == ["r-g0-0", "r-g0-1"]
    assert detail["siblings"][1]["final_response"] == "ANSWER: 3 <eos>"

    # The two calls extend one another: one sample, tool output masked, as build_samples makes it.
    [sample] = detail["samples"]
    triplets = [t.model_dump() for t in run(folder.store.triplets("r-g0-0")).triplets]
    [expected] = build_samples("r-g0-0", "g0", triplets, 1.0, None)
    assert [t["id"] for t in sample["tokens"]] == expected.input_ids
    assert [t["mask"] for t in sample["tokens"]] == expected.loss_mask
    trained = [t["text"] for t in sample["tokens"] if t["mask"]]
    assert trained == "CALL calc(2+3) ANSWER: 5 <eos>".split()
    context = [t["text"] for t in sample["tokens"] if not t["mask"]]
    assert context[-4:] == ["user", "=", "5", "assistant"]  # the tool's reply, not trained
    assert all(t["logprob"] == -0.25 and t["version"] == 0 for t in sample["tokens"] if t["mask"])
    assert all(t["logprob"] is None and t["version"] is None for t in sample["tokens"] if not t["mask"])
    assert sample["advantage"] == pytest.approx(0.7071, abs=1e-3)


def test_a_retried_rollout_shows_both_attempts_and_trains_on_the_last(folder):
    detail = run(folder.rollout("r-g0-1"))
    assert [(a["attempt_id"], a["state"]) for a in detail["attempts"]] == [("a1", "failed"), ("a2", "succeeded")]
    assert detail["attempts"][0]["error_message"] == "agent exited with code 1"
    assert detail["trained_attempt"] == "a2"
    assert [t["version"] for t in detail["samples"][0]["tokens"] if t["mask"]] == [1, 1, 1]


def test_each_call_and_sample_shows_its_policy(tmp_path):
    """A planner and a solver in one conversation: each call names its policy and the name the
    engine served it under; the solver's call extends the planner's prompt but is a sample of
    its own, the planner's reply context in it."""
    run_dir = write_run(tmp_path / "run")
    planned = call_event("user what is 2 + 3 ? assistant", "CALL calc(2+3)", 3)
    solved = call_event(
        "user what is 2 + 3 ? assistant CALL calc(2+3) user = 5 assistant", "ANSWER: 5 <eos>", 3, tool=True
    )

    async def add(store: RolloutStore) -> None:
        await store.add_rollouts([RolloutCreate(rollout_id="r-two", metadata={"data_id": "g2", "enqueued_step": 0})])
        await store.update_status("r-two", StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        for event, policy in ((planned, "planner"), (solved, "solver")):
            data = event.data | {"model": f"{policy}-v3", "policy": policy}
            await store.add_event("r-two", "a1", EventCreate(event_type="model_request", data=data))
        await store.add_event("r-two", "a1", EventCreate(event_type="reward", data={"value": 1.0}))
        await store.update_status("r-two", StatusFields(state=RolloutState.SUCCEEDED))

    store = RolloutStore(run_dir / "store.db")
    try:
        run(add(store))
    finally:
        store.close()
    folder = RunFolder(run_dir)
    try:
        detail = run(folder.rollout("r-two"))
        one_policy = run(folder.rollout("r-g0-0"))
    finally:
        folder.close()
    assert [(c["policy"], c["model"], c["policy_version"]) for c in detail["calls"]] == [
        ("planner", "planner-v3", 3),
        ("solver", "solver-v3", 3),
    ]
    assert [s["policy"] for s in detail["samples"]] == ["planner", "solver"]
    trained = [[t["text"] for t in s["tokens"] if t["mask"]] for s in detail["samples"]]
    assert trained == [["CALL", "calc(2+3)"], ["ANSWER:", "5", "<eos>"]]
    # A run of one policy shows none.
    assert {c["policy"] for c in one_policy["calls"]} == {None}
    assert [s["policy"] for s in one_policy["samples"]] == [None]


def test_without_a_tokenizer_tokens_are_ids(tmp_path):
    run_dir = write_run(tmp_path / "run")
    (run_dir / "checkpoints" / "latest").unlink()
    folder = RunFolder(run_dir)
    try:
        detail = run(folder.rollout("r-g0-0"))
    finally:
        folder.close()
    assert "no tokenizer" in detail["tokenizer"]
    assert all(t["text"] is None for t in detail["samples"][0]["tokens"])
    assert [t["id"] for t in detail["samples"][0]["tokens"]][:3] == ids("user what is")


def test_metrics_skip_the_line_being_written(folder):
    rows = folder.metrics()
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    with open(folder.metrics_path, "a") as handle:
        handle.write('{"step": 3, "critic/score/me')  # the trainer is mid-write
    assert [r["step"] for r in folder.metrics()] == [0, 1, 2, 2]
    with open(folder.metrics_path, "a") as handle:
        handle.write('an": 1.0}\n')
    assert folder.metrics()[-1] == {"step": 3, "critic/score/mean": 1.0}


def test_timeline_lays_out_each_step_from_its_metrics(folder):
    timeline = run(folder.timeline())
    [one, two] = timeline["steps"]
    phases = {s["phase"]: s["end"] - s["start"] for s in one["segments"]}
    assert phases == pytest.approx({"rollout wait": 1.5, "drain": 0.2, "update": 1.0, "weight sync": 0.2})
    assert one["end"] - one["start"] == pytest.approx(3.0)
    # step 1's pause lasted until step 2's resume: step 2's timing/gateway_pause_s
    assert one["pause"]["end"] - one["pause"]["start"] == pytest.approx(1.6)
    assert two["pause"] is None  # nothing after it says when it ended
    assert [e["step"] for e in timeline["evaluations"]] == [0]


def test_the_viewer_never_writes_the_run(tmp_path):
    run_dir = write_run(tmp_path / "run")
    before = hashlib.sha256((run_dir / "store.db").read_bytes()).hexdigest()
    folder = RunFolder(run_dir)
    run(folder.rollouts())
    run(folder.rollout("r-g0-0"))
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        run(folder.store.add_rollouts([RolloutCreate(input=1)]))
    folder.close()
    assert hashlib.sha256((run_dir / "store.db").read_bytes()).hexdigest() == before


def test_not_a_run_folder(tmp_path):
    with pytest.raises(RunFolderError, match="neither store.db nor metrics.jsonl"):
        RunFolder(tmp_path)
    with pytest.raises(RunFolderError, match="is not a folder"):
        RunFolder(tmp_path / "missing")
    with pytest.raises(StoreError, match="does not exist"):
        RolloutStore(tmp_path / "missing.db", read_only=True)


def test_bulk_rewards_read_like_triplets(tmp_path):
    """`rewards()` (one query for the list) agrees with `triplets()` (the trainer's read)."""
    store = RolloutStore(tmp_path / "s.db")

    async def scenario():
        await store.add_rollouts([RolloutCreate(rollout_id=r) for r in ("a", "b", "c")])
        for rid in ("a", "b"):
            await store.update_status(rid, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        await store.add_event("a", "a1", EventCreate(event_type="reward", data={"value": 0.2}))
        await store.add_event("a", "a1", EventCreate(event_type="reward", data={"value": 0.9}))  # last one wins
        await store.record_event("a", "a1", "reward", {"value": "bad"})  # one stored before rewards were checked
        await store.update_status("b", StatusFields(state=RolloutState.QUEUING))  # retried: a1 failed
        await store.add_event("b", "a1", EventCreate(event_type="reward", data={"value": 1.0}))
        await store.update_status("b", StatusFields(state=RolloutState.RUNNING, last_attempt_id="a2"))  # no reward yet
        bulk = await store.rewards(["a", "b", "c"])
        each = {rid: (await store.triplets(rid)).reward for rid in ("a", "b", "c")}
        return bulk, each

    bulk, each = run(scenario())
    store.close()
    assert bulk == each == {"a": 0.9, "b": None, "c": None}


@pytest.mark.slow
def test_reading_while_a_writer_writes(tmp_path):
    """A reader on the live store (WAL, mode=ro) never makes the writer wait or fail."""
    path = tmp_path / "store.db"
    writer = RolloutStore(path)
    run(writer.add_rollouts([RolloutCreate(rollout_id="r", metadata={"data_id": "g"})]))
    run(writer.update_status("r", StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1")))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": time.time()}) + "\n")
    stop = threading.Event()
    errors: list[BaseException] = []
    writes = 0

    def write() -> None:
        async def loop() -> None:
            nonlocal writes
            payload = EventCreate(event_type="model_request", data={"blob": "x" * 2000})
            while not stop.is_set():
                await writer.add_event("r", "a1", payload)  # SQLITE_BUSY here if the reader blocked it
                writes += 1

        try:
            asyncio.run(loop())
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    folder = RunFolder(tmp_path)
    seen = []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            seen.append(len(run(folder.store.list_events("r"))))
            run(folder.rollouts())
    finally:
        stop.set()
        thread.join()
        folder.close()
        writer.close()
    assert not errors, errors
    assert writes > 10
    assert len(seen) > 3 and seen[-1] > seen[0]  # the reader sees the writer's progress


def test_each_call_shows_the_rewards_posted_for_its_turn(tmp_path):
    run_dir = write_run(tmp_path / "run")
    first = call_event("user what is 2 + 3 ? assistant", "CALL calc(2+3)", 3)
    second = call_event("user what is 2 + 3 ? assistant CALL calc(2+3) user = 5 assistant", "ANSWER: 5 <eos>", 3)

    async def add(store: RolloutStore) -> None:
        await store.add_rollouts([RolloutCreate(rollout_id="r-turns", metadata={"data_id": "g3", "enqueued_step": 0})])
        await store.update_status("r-turns", StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        for event, call_id in ((first, "c1"), (second, "c2")):
            data = event.data | {"call_id": call_id}
            await store.add_event("r-turns", "a1", EventCreate(event_type="model_request", data=data))
            await store.add_event("r-turns", "a1", EventCreate(event_type="reward", data={"value": 0.25}))
        await store.update_status("r-turns", StatusFields(state=RolloutState.SUCCEEDED))

    store = RolloutStore(run_dir / "store.db")
    try:
        run(add(store))
    finally:
        store.close()
    folder = RunFolder(run_dir)
    try:
        detail = run(folder.rollout("r-turns"))
    finally:
        folder.close()
    # The first reward came mid-rollout: its turn's; the last one, after the last call, is the outcome.
    assert [c["reward"] for c in detail["calls"]] == [0.25, None]
    assert detail["reward"] == 0.25
