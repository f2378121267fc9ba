"""The calc agent's reward per turn (ROLLOVER_CALC_TURN_REWARD): run by the controller against
the gateway and a scripted engine, it names the call whose calculator call was well formed, and
the store gives that call the turn's reward and the rollout its outcome."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from examples.calc.task import make_tasks
from examples.harness.capture import Script, scripted_engine
from rollover.controller import Controller
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.store.models import RolloutCreate, RolloutState
from rollover.store.rewards import attribute_rewards
from tests.conftest import ADMIN_KEY
from tests.controller.conftest import make_config, wait_for_rollout


class CalcScript(Script):
    """A calculator call first, then the answer once the tool's result is in the messages."""

    def reply(self, body: dict[str, Any]) -> tuple[str | None, str]:
        self_called = any(isinstance(m, dict) and m.get("role") == "tool" for m in body.get("messages") or [])
        return None, self.answer if self_called else f"<calc>{self.arguments['expression']}</calc>"


async def run_calc(task: dict[str, Any], turn_reward: str, log_dir: Path) -> list[tuple[int, str, Any]]:
    """The rollout's events, `(event id, type, data)` in order."""
    script = CalcScript("calc", {"expression": task["expression"]}, f"ANSWER: {task['answer']}")
    with scripted_engine(script) as engine, GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as gateway:
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            await client.register_models([{"model": "policy", "endpoint": engine}])
            env = {"ROLLOVER_CALC_TURN_REWARD": turn_reward, "ROLLOVER_CALC_LATENCY_MEDIAN": "0.01"}
            config = make_config(local={"agent_class": "examples.calc.agent.CalcAgent", "env": env})
            async with Controller(config, client, log_dir=log_dir, poll_interval=0.1):
                [rollout] = await client.enqueue([RolloutCreate(input=task)])
                done = await wait_for_rollout(client, rollout.rollout_id, timeout=120)
            assert done.state == RolloutState.SUCCEEDED, done.status
            events = await client.events(rollout.rollout_id)
            return [(e.event_id, e.event_type, e.data) for e in events]


def test_the_calc_agent_names_the_well_formed_call_with_its_turn_reward(tmp_path: Path) -> None:
    [task] = make_tasks(1, seed=3)
    events = asyncio.run(run_calc(task, "0.1", tmp_path / "logs"))
    calls = [(event_id, data["call_id"]) for event_id, kind, data in events if kind == "model_request"]
    assert len(calls) == 2  # the calculator call, then the answer
    rewards = [data for _, kind, data in events if kind == "reward"]
    assert rewards == [{"value": 0.1, "call_id": calls[0][1]}, {"value": 1.0}]
    attributed = attribute_rewards(events)
    assert attributed.per_call == {calls[0][0]: 0.1} and attributed.outcome == 1.0


def test_without_the_knob_the_calc_agent_posts_its_outcome_alone(tmp_path: Path) -> None:
    [task] = make_tasks(1, seed=3)
    events = asyncio.run(run_calc(task, "0", tmp_path / "logs"))
    assert [data for _, kind, data in events if kind == "reward"] == [{"value": 1.0}]
    attributed = attribute_rewards(events)
    assert attributed.per_call == {} and attributed.outcome == 1.0
