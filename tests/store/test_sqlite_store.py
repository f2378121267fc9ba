import asyncio
import json
import sqlite3

import pytest

from rollover.store import (
    AttemptNotFound,
    EventCreate,
    IllegalTransition,
    RolloutCreate,
    RolloutNotFound,
    RolloutState,
    RolloutStore,
    StatusFields,
)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store(tmp_path):
    s = RolloutStore(tmp_path / "store.db")
    yield s
    s.close()


def test_file_store_uses_wal(tmp_path):
    s = RolloutStore(tmp_path / "wal.db")
    s.close()
    mode = sqlite3.connect(tmp_path / "wal.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_lifecycle_and_attempts(store):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate(input={"q": 1}, metadata={"data_id": "d"})])
        assert r.state == RolloutState.QUEUING and r.attempts == []
        r = await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING))
        assert r.status.last_attempt_id == "0" and r.started_at is not None  # Agent Lightning's default id
        r = await store.update_status(r.rollout_id, StatusFields(state=RolloutState.QUEUING, error_message="boom"))
        assert r.attempts[0].state == RolloutState.FAILED and r.attempts[0].error_message == "boom"
        r = await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a2"))
        assert r.status.error_message is None
        r = await store.update_status(r.rollout_id, StatusFields(state=RolloutState.SUCCEEDED))
        assert [a.state for a in r.attempts] == [RolloutState.FAILED, RolloutState.SUCCEEDED]
        assert r.finished_at >= r.started_at >= r.created_at
        return r

    run(scenario())


@pytest.mark.parametrize(
    "named,started",
    [
        ([None], ["0"]),  # Agent Lightning's default attempt id
        ([None, None, None], ["0", "1", "2"]),  # run again after a re-queue: the next number
        (["a1", None], ["a1", "1"]),  # Rollover's controller names its attempts
        (["1", None], ["1", "2"]),  # a number already taken is skipped
        (["a1", "a2"], ["a1", "a2"]),
    ],
)
def test_running_without_an_attempt_id_starts_the_default_one(store, named, started):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate()])
        for position, attempt_id in enumerate(named):
            if position:
                await store.update_status(r.rollout_id, StatusFields(state=RolloutState.QUEUING))
            fields = {"state": RolloutState.RUNNING} | ({} if attempt_id is None else {"last_attempt_id": attempt_id})
            r = await store.update_status(r.rollout_id, StatusFields(**fields))
            assert r.status.last_attempt_id == started[position]
        assert [a.attempt_id for a in r.attempts] == started
        assert store.snapshot(r.rollout_id).attempts == tuple(started)
        # the attempt exists: it takes events
        await store.add_event(r.rollout_id, started[-1], EventCreate(event_type="reward", data={"value": 1}))

    run(scenario())


@pytest.mark.parametrize(
    "path,illegal",
    [
        ([], RolloutState.SUCCEEDED),  # queuing -> succeeded skips running
        ([RolloutState.RUNNING, RolloutState.SUCCEEDED], RolloutState.RUNNING),  # terminal is final
        ([RolloutState.RUNNING, RolloutState.FAILED], RolloutState.QUEUING),
    ],
)
def test_illegal_transitions_change_nothing(store, path, illegal):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate()])
        for state in path:
            r = await store.update_status(r.rollout_id, StatusFields(state=state))
        with pytest.raises(IllegalTransition):
            await store.update_status(r.rollout_id, StatusFields(state=illegal, error_message="x"))
        after = await store.get_rollout(r.rollout_id)
        assert after == r

    run(scenario())


def test_caller_id_is_idempotent_and_never_clobbers(store):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate(rollout_id="fixed", input=1)])
        await store.update_status("fixed", StatusFields(state=RolloutState.RUNNING))
        [again] = await store.add_rollouts([RolloutCreate(rollout_id="fixed", input=2)])
        assert again.input == 1 and again.state == RolloutState.RUNNING
        assert len(await store.list_rollouts()) == 1

    run(scenario())


def test_events_need_a_known_attempt_and_triplets_take_the_last_reward(store):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate()])
        with pytest.raises(RolloutNotFound):
            await store.add_event("nope", "a1", EventCreate(event_type="reward", data={"value": 1}))
        await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        call = {"prompt_token_ids": [1, 2], "response_token_ids": [3], "response_logprobs": [-0.5], "policy_version": 4}
        await store.add_event(r.rollout_id, "a1", EventCreate(event_type="model_request", data=call))
        await store.add_event(r.rollout_id, "a1", EventCreate(event_type="reward", data={"value": 0.0}))
        await store.add_event(r.rollout_id, "a1", EventCreate(event_type="reward", data={"value": 1.0}))
        bundle = await store.triplets(r.rollout_id)
        assert bundle.reward == 1.0 and bundle.attempt_id == "a1"
        [t] = bundle.triplets
        assert (t.prompt_token_ids, t.response_token_ids, t.response_logprobs, t.policy_version) == (
            [1, 2],
            [3],
            [-0.5],
            4,
        )
        assert [e.event_type for e in await store.list_events(r.rollout_id, event_type="reward")] == [
            "reward",
            "reward",
        ]

    run(scenario())


def test_triplets_carry_the_policy_each_call_asked_for(store):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate()])
        await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        call = {"prompt_token_ids": [1, 2], "response_token_ids": [3], "response_logprobs": [-0.5], "policy_version": 4}
        two_choices = [{"index": i, "response_token_ids": [5 + i], "response_logprobs": [-0.1]} for i in range(2)]
        for data in (
            call | {"policy": "planner"},
            call | {"policy": "solver", "choices": two_choices},  # n > 1: every choice is the call's policy's
            call,  # a run of one policy records none
            call | {"policy": 7},  # not the proxy's: read as none rather than failing the rollout's read
        ):
            await store.add_event(r.rollout_id, "a1", EventCreate(event_type="model_request", data=data))
        bundle = await store.triplets(r.rollout_id)
        assert [(t.policy, t.choice_index) for t in bundle.triplets] == [
            ("planner", 0),
            ("solver", 0),
            ("solver", 1),
            (None, 0),
            (None, 0),
        ]

    run(scenario())


def test_list_filters(store):
    async def scenario():
        rs = await store.add_rollouts([RolloutCreate() for _ in range(5)])
        await store.update_status(rs[1].rollout_id, StatusFields(state=RolloutState.RUNNING))
        queued = await store.list_rollouts(state_in=[RolloutState.QUEUING])
        assert [r.rollout_id for r in queued] == [rs[i].rollout_id for i in (0, 2, 3, 4)]
        assert len(await store.list_rollouts(state_in=[RolloutState.QUEUING], limit=2)) == 2
        some = await store.list_rollouts(rollout_ids=[rs[4].rollout_id, rs[1].rollout_id])
        assert {r.rollout_id for r in some} == {rs[4].rollout_id, rs[1].rollout_id}

    run(scenario())


def test_reopening_the_file_keeps_everything(tmp_path):
    path = tmp_path / "durable.db"
    first = RolloutStore(path)

    async def write():
        [r] = await first.add_rollouts([RolloutCreate(input={"x": 1})])
        await first.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        await first.add_event(r.rollout_id, "a1", EventCreate(event_type="reward", data={"value": 0.5}))
        return r.rollout_id

    rollout_id = run(write())
    first.close()
    second = RolloutStore(path)
    bundle = run(second.triplets(rollout_id))
    assert bundle.reward == 0.5
    assert run(second.get_rollout(rollout_id)).state == RolloutState.RUNNING
    second.close()


def test_failed_again_keeps_the_first_error_message(store):
    async def scenario():
        [r] = await store.add_rollouts([RolloutCreate()])
        await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING))
        await store.update_status(
            r.rollout_id, StatusFields(state=RolloutState.FAILED, error_message="openai.RateLimitError: 429")
        )
        again = await store.update_status(
            r.rollout_id, StatusFields(state=RolloutState.FAILED, error_message="exit code 1")
        )
        assert again.status.state == RolloutState.FAILED
        assert again.status.error_message == "openai.RateLimitError: 429"
        assert again.attempts[0].error_message == "openai.RateLimitError: 429"
        # a failure that had no message yet may still get one
        [q] = await store.add_rollouts([RolloutCreate()])
        await store.update_status(q.rollout_id, StatusFields(state=RolloutState.FAILED))
        later = await store.update_status(q.rollout_id, StatusFields(state=RolloutState.FAILED, error_message="why"))
        assert later.status.error_message == "why"

    run(scenario())


def test_one_group_commit_keeps_the_writes_beside_a_refused_one(tmp_path):
    """Writes made together share one transaction; a refused one changes nothing, the others
    are all committed (and the in-memory snapshot agrees with the file)."""
    path = tmp_path / "group.db"
    store = RolloutStore(path)

    async def scenario():
        a, b, c = await store.add_rollouts([RolloutCreate() for _ in range(3)])
        commits_before = store._file._checkpointer.commits
        results = await asyncio.gather(
            store.update_status(a.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1")),
            store.update_status(b.rollout_id, StatusFields(state=RolloutState.SUCCEEDED)),  # illegal
            store.add_event(c.rollout_id, "a1", EventCreate(event_type="reward", data={"value": 1})),  # no attempt yet
            store.update_status(c.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1")),
            store.add_event(a.rollout_id, "a1", EventCreate(event_type="reward", data={"value": 2})),
            return_exceptions=True,
        )
        assert store._file._checkpointer.commits == commits_before + 1  # one transaction for all five
        return a.rollout_id, b.rollout_id, c.rollout_id, results

    a, b, c, results = run(scenario())
    assert results[0].state == RolloutState.RUNNING and results[3].state == RolloutState.RUNNING
    assert isinstance(results[1], IllegalTransition) and isinstance(results[2], AttemptNotFound)
    assert results[4].event_id > 0
    assert store.snapshot(c).attempts == ("a1",) and store.snapshot(b).state == RolloutState.QUEUING
    store.close()
    reopened = RolloutStore(path)
    assert run(reopened.get_rollout(b)).state == RolloutState.QUEUING
    assert [e.data for e in run(reopened.list_events(a))] == [{"value": 2}]
    assert run(reopened.list_events(c)) == []
    assert reopened.snapshot(a).attempts == ("a1",)
    reopened.close()


def test_values_that_are_not_standard_json_are_refused_before_storing(store):
    from rollover.store import StoreError

    async def scenario():
        deep: list = []
        for _ in range(300):
            deep = [deep]
        for bad in ("\ud800", deep):  # (NaN is written as null, orjson's rule)
            with pytest.raises(StoreError) as refused:
                await store.add_rollouts([RolloutCreate(input=bad)])
            assert refused.value.status_code == 422
        assert await store.list_rollouts() == []

    run(scenario())


def test_the_batch_posts_json_is_what_the_models_would_write(store):
    """`add_rollouts_json` writes each new rollout without its model: byte for byte what
    `Rollout.model_dump_json` writes for it as read back, and a rollout already there as it is."""
    items = [
        RolloutCreate(input={"q": "é", "n": [1, 2.5, None]}, metadata={"data_id": "d", "deep": {"x": [True]}}),
        RolloutCreate(input="text", is_train=False),
        RolloutCreate(input=None, config={"timeout_seconds": 3, "local": {"env_map": {"A": "1"}}}),
        RolloutCreate(rollout_id="mine", input=[1], config={"k8s": {"job_template": "t.yaml"}}),
    ]

    async def scenario():
        await store.add_rollouts([RolloutCreate(rollout_id="there", input=0)])
        raw = await store.add_rollouts_json([*items, RolloutCreate(rollout_id="there", input=9)])
        written = json.loads(raw)
        assert len(written) == 5 and written[3]["rollout_id"] == "mine" and written[4]["input"] == 0
        for rollout in written:
            stored = await store.get_rollout(rollout["rollout_id"])
            assert json.dumps(rollout, separators=(",", ":"), ensure_ascii=False) == stored.model_dump_json()

    run(scenario())


def test_event_ids_grow_and_are_never_reused_after_deletes_and_restarts(tmp_path):
    path = tmp_path / "ids.db"

    async def started(store):
        [r] = await store.add_rollouts([RolloutCreate(input={})])
        await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        return r.rollout_id

    async def post(store, rollout_id, count):
        reward = EventCreate(event_type="reward", data={"value": 1.0})
        return [(await store.add_event(rollout_id, "a1", reward)).event_id for _ in range(count)]

    first = RolloutStore(path)
    kept, newest = run(started(first)), run(started(first))
    ids = run(post(first, kept, 2)) + run(post(first, newest, 3))
    assert ids == sorted(ids) and len(set(ids)) == 5
    run(first.delete_rollout(newest))  # the highest ids go with it
    first.close()

    second = RolloutStore(path)
    again = run(started(second))
    [after_restart] = run(post(second, again, 1))
    assert after_restart > max(ids)  # not SQLite's max(rowid) + 1, which the delete lowered
    second.close()


def test_a_file_made_with_autoincrement_event_ids_goes_on_after_its_highest(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE events (event_id INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT NOT NULL,"
        " attempt_id TEXT NOT NULL, event_type TEXT NOT NULL, data TEXT NOT NULL, created_at REAL NOT NULL);"
        "INSERT INTO events VALUES (41, 'gone', 'a1', 'reward', '{}', 0);"
        "DELETE FROM events;"
    )
    old.commit()
    old.close()
    store = RolloutStore(path)

    async def one_event():
        [r] = await store.add_rollouts([RolloutCreate(input={})])
        await store.update_status(r.rollout_id, StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        return (
            await store.add_event(r.rollout_id, "a1", EventCreate(event_type="reward", data={"value": 1.0}))
        ).event_id

    assert run(one_event()) == 42
    store.close()


def test_generated_rollout_ids_are_unique_and_in_the_order_they_were_made(store):
    """Made in order so a batch's inserts land at the end of the rollout-id index (see
    `new_rollout_id`); ids of one millisecond differ by their random part."""

    async def scenario():
        first = await store.add_rollouts([RolloutCreate(input=i) for i in range(64)])
        await asyncio.sleep(0.002)  # the next batch is made in a later millisecond
        second = await store.add_rollouts([RolloutCreate(input=i) for i in range(64)])
        return [r.rollout_id for r in first], [r.rollout_id for r in second]

    first, second = run(scenario())
    ids = first + second
    assert len(set(ids)) == 128
    assert all(len(i) == 34 and i.startswith("r-") and int(i[2:], 16) >= 0 for i in ids)
    assert max(first) < min(second)


def test_a_config_stored_with_a_null_timeout_is_answered_without_one(tmp_path):
    """Files written before the wire left out a missing timeout (Agent Lightning's `int`
    refuses null) have `"timeout_seconds": null` in their configs: read back as no timeout."""
    path = tmp_path / "old.db"
    store = RolloutStore(path)
    [r] = run(store.add_rollouts([RolloutCreate(input=1)]))
    store.close()
    with sqlite3.connect(path) as conn:
        (config,) = conn.execute("SELECT config FROM rollouts").fetchone()
        assert "timeout_seconds" not in json.loads(config)  # as written now
        old = json.dumps(json.loads(config) | {"timeout_seconds": None})
        conn.execute("UPDATE rollouts SET config=?", (old,))
    store = RolloutStore(path)
    rollout = run(store.get_rollout(r.rollout_id))
    store.close()
    assert rollout.config.timeout_seconds is None
    assert "timeout_seconds" not in json.loads(rollout.model_dump_json())["config"]
