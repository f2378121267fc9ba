"""The window, group completeness and carry-over, with completion order under test control."""

import asyncio

import pytest

from rollover.store.models import RolloutState
from rollover.training.manager import AsyncRolloutManager, Prompt, TrackedRollout
from tests.training.scripted_backend import ScriptedBackend


def prompts(*ids):
    return [Prompt(data_id=i, input={"q": i}) for i in ids]


def test_stops_at_target_complete_groups_and_carries_the_rest():
    backend = ScriptedBackend()
    manager = AsyncRolloutManager(backend, train_rollout_n=2)

    async def scenario():
        task = asyncio.create_task(
            manager.enqueue_and_wait_until_group_completed(prompts("a", "b", "c", "d"), [], 2, step=0)
        )
        await asyncio.sleep(0)
        a, b, c, d = (backend.ids_of(x) for x in "abcd")
        backend.script = [
            [a[0], b[0], c[0]],  # no group complete yet: one member of each still running
            [c[1]],  # c complete
            [a[1]],  # a complete -> target reached
        ]
        return await task

    result = asyncio.run(scenario())
    assert [g[0].data_id for g in result.completed_groups] == ["c", "a"]
    assert sorted({r.data_id for r in result.new_carry_over_rollouts}) == ["b", "d"]
    assert len(result.new_carry_over_rollouts) == 4
    # b's finished member is carried with its group, not consumed
    assert any(r.state == RolloutState.SUCCEEDED for r in result.new_carry_over_rollouts if r.data_id == "b")


def test_a_group_with_one_member_running_is_never_consumed():
    backend = ScriptedBackend()
    manager = AsyncRolloutManager(backend, train_rollout_n=3)

    async def scenario():
        task = asyncio.create_task(manager.enqueue_and_wait_until_group_completed(prompts("a", "b"), [], 1, step=0))
        await asyncio.sleep(0)
        a, b = backend.ids_of("a"), backend.ids_of("b")
        backend.script = [[a[0], a[1], b[0], b[1]], [], [b[2]]]
        return await task

    result = asyncio.run(scenario())
    assert [g[0].data_id for g in result.completed_groups] == ["b"]
    assert backend.waits == 3


def test_carry_over_is_merged_and_consumed_later():
    backend = ScriptedBackend()
    manager = AsyncRolloutManager(backend, train_rollout_n=2)

    async def scenario():
        task = asyncio.create_task(manager.enqueue_and_wait_until_group_completed(prompts("a", "b"), [], 1, step=0))
        await asyncio.sleep(0)
        a, b = backend.ids_of("a"), backend.ids_of("b")
        backend.script = [[a[0], a[1]]]
        first = await task
        assert [r.data_id for r in first.new_carry_over_rollouts] == ["b", "b"]
        task = asyncio.create_task(
            manager.enqueue_and_wait_until_group_completed(prompts("c"), first.new_carry_over_rollouts, 1, step=1)
        )
        await asyncio.sleep(0)
        backend.script = [[b[0], b[1]]]
        return await task

    second = asyncio.run(scenario())
    assert [g[0].data_id for g in second.completed_groups] == ["b"]
    assert second.completed_groups[0][0].enqueued_step == 0
    assert [r.data_id for r in second.new_carry_over_rollouts] == ["c", "c"]


def test_more_complete_groups_than_needed_keeps_the_extra_for_later():
    backend = ScriptedBackend()
    manager = AsyncRolloutManager(backend, train_rollout_n=1)

    async def scenario():
        task = asyncio.create_task(
            manager.enqueue_and_wait_until_group_completed(prompts("a", "b", "c"), [], 1, step=0)
        )
        await asyncio.sleep(0)
        backend.script = [[*backend.ids_of("a"), *backend.ids_of("b"), *backend.ids_of("c")]]
        return await task

    result = asyncio.run(scenario())
    assert len(result.completed_groups) == 1 and len(result.new_carry_over_rollouts) == 2


def test_wrong_group_size_is_an_assertion():
    backend = ScriptedBackend()
    manager = AsyncRolloutManager(backend, train_rollout_n=4)
    lonely = [TrackedRollout(rollout_id="x", data_id="g", input=None, enqueued_step=0)]
    with pytest.raises(AssertionError, match="actor_rollout_ref.rollout.n=4"):
        asyncio.run(manager.enqueue_and_wait_until_group_completed([], lonely, 1, step=0))
