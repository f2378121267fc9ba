"""An agent written for Agent Lightning (the mcp_calc example: the OpenAI Agents SDK with an MCP
tool server, `max_retries=6`) launched just before a long update rides it out when the gateway
holds calls during a pause (gateway.hold_while_paused), and its rollout finishes SUCCEEDED.

The pause is more than twice as long as the agent's client retries last against the seed's
immediate 429 (6 retries x Retry-After 0.25 s = 1.5 s): the client alone would give up
(tests/gateway/test_pause_hold.py shows the 429 path with the same client library)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from examples.mcp_calc.prepare import make_tasks
from rollover.controller import Controller
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.store.models import RolloutCreate, RolloutState
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY
from tests.controller.conftest import make_config, wait_for_rollout, wait_until

pytestmark = pytest.mark.slow  # a 4 s pause by design

RETRY_AFTER_SECONDS = 0.25
CLIENT_RETRIES = 6  # examples/mcp_calc/agent.py
HELD_SECONDS = 2 * CLIENT_RETRIES * RETRY_AFTER_SECONDS + 1  # 4 s


async def test_the_agents_sdk_agent_rides_out_a_pause_longer_than_its_retries(tmp_path: Path) -> None:
    with (
        StubUpstream() as stub,
        GatewayThread(
            store=":memory:", admin_key=ADMIN_KEY, retry_after_seconds=RETRY_AFTER_SECONDS, hold_while_paused=True
        ) as gateway,
    ):
        # When the agent's first call reaches the pause (read in the gateway's process).
        pause = gateway.server.config.app.state.gateway.pause
        arrivals: list[float] = []
        try_enter = pause.try_enter

        async def noting_arrival(hold_seconds: float = 0.0) -> Any:
            arrivals.append(time.monotonic())
            return await try_enter(hold_seconds)

        pause.try_enter = noting_arrival
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            await client.register_models([{"model": "policy", "endpoint": stub.base_url}])
            config = make_config(
                local={
                    "agent_class": "examples.mcp_calc.agent.CalcAgent",  # Agent Lightning's dotted form
                    "env_map": {"QUESTION": "input.question", "ANSWER": "input.answer"},
                }
            )
            [task] = make_tasks(1, seed=5)
            async with Controller(config, client, log_dir=tmp_path / "logs", poll_interval=0.1):
                await client.pause(reason="a long update")  # the agent is launched into it
                [rollout] = await client.enqueue([RolloutCreate(input=task)])
                await wait_until(lambda: bool(arrivals), timeout=60)
                await asyncio.sleep(HELD_SECONDS)
                assert not stub.behaviour.requests  # held at the gateway all along
                resumed = time.monotonic()
                await client.resume()
                done = await wait_for_rollout(client, rollout.rollout_id, timeout=60)
            bundle = await client.triplets(rollout.rollout_id)
    assert resumed - arrivals[0] >= HELD_SECONDS > 2 * CLIENT_RETRIES * RETRY_AFTER_SECONDS
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert done.state == RolloutState.SUCCEEDED, (done.status, logs)
    assert stub.behaviour.requests and stub.behaviour.requests[0]["tools"]  # the MCP server's tool went along
    assert bundle.reward is not None and len(bundle.triplets) == len(stub.behaviour.requests)  # recorded, rewarded
