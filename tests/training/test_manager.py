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


class GroupScript(ScriptedBackend):
    """Each wait() finishes every member of the groups (data ids) the script names next, or
    every running rollout for "*"."""

    async def wait(self) -> None:
        await asyncio.sleep(0)
        self.waits += 1
        self.clock += 1.0
        if not self.script:
            raise AssertionError("the manager waited although the script is over")
        names = self.script.pop(0)
        for r in self.enqueued:
            if (r.data_id in names or "*" in names) and self.states[r.rollout_id] == RolloutState.RUNNING:
                self.states[r.rollout_id] = RolloutState.SUCCEEDED


def test_a_group_whose_members_scored_alike_neither_counts_nor_trains_and_is_replaced():
    from rollover.training.manager import GroupFilter

    backend = GroupScript()
    scores = {"a": [1.0, 1.0], "b": [1.0, 0.0], "c": [0.0, 0.0], "d": [0.0, 1.0], "e": [1.0, 0.0]}  # a, c: alike
    fresh = iter("de")

    async def group_scores(group):
        return scores[group[0].data_id]

    manager = AsyncRolloutManager(
        backend, train_rollout_n=2, group_filter=GroupFilter(group_scores, lambda n: prompts(next(fresh)))
    )
    backend.script = [["a", "c"], ["b"], ["e"], ["d"]]
    result = asyncio.run(manager.enqueue_and_wait_until_group_completed(prompts("a", "b", "c"), [], 3, step=0))
    assert [g[0].data_id for g in result.completed_groups] == ["b", "e", "d"]
    assert sorted(g[0].data_id for g in result.filtered_groups) == ["a", "c"]
    # one new group per filtered one, enqueued at once: the window stayed three groups wide
    enqueued = [r.data_id for r in backend.enqueued]
    assert enqueued.count("d") == 2 and enqueued.count("e") == 2
    assert not result.new_carry_over_rollouts


def test_the_filter_gives_up_with_one_line_when_no_group_has_signal():
    from rollover.training.manager import GroupFilter, NoSignal

    backend = GroupScript()
    fresh = iter(range(100))

    async def all_solved(group):
        return [1.0, 1.0]

    manager = AsyncRolloutManager(
        backend,
        train_rollout_n=2,
        group_filter=GroupFilter(all_solved, lambda n: prompts(f"p{next(fresh)}"), max_filtered=3),
    )
    backend.script = [["*"]] * 10
    with pytest.raises(NoSignal) as excinfo:
        asyncio.run(manager.enqueue_and_wait_until_group_completed(prompts("a", "b"), [], 1, step=0))
    message = str(excinfo.value)
    assert "3 complete groups" in message and "3 at 1" in message and "max_num_gen_batches" in message
    assert "\n" not in message
