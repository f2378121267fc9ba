"""The controller with the local runner: real agent processes against a real gateway."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from rollover.config import ConfigError
from rollover.controller import Controller, ControllerConfigError
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread, free_port
from rollover.store.models import RolloutCreate, RolloutState
from tests.conftest import ADMIN_KEY
from tests.controller.conftest import (
    HandClock,
    alive,
    assert_group_gone,
    cli_controller_with_an_agent,
    make_config,
    new_id,
    read_pids,
    wait_for_file,
    wait_for_rollout,
    wait_gone,
    wait_until,
)

AGENTS = "tests.controller.agents"


@asynccontextmanager
async def run_controller(
    client: GatewayClient,
    tmp_path: Path,
    agent: str,
    start_method: str,
    clock: HandClock | None = None,
    **settings: Any,
) -> AsyncIterator[Controller]:
    # Unsandboxed unless a test asks: these agents share files and pids with the test
    # (tests/controller/test_sandbox.py runs the sandbox's own).
    local = {
        "agent_class": f"{AGENTS}:{agent}",
        "start_method": start_method,
        "sandbox": False,
        **settings.pop("local", {}),
    }
    config = make_config(local=local, **settings)
    async with Controller(
        config, client, log_dir=tmp_path / "logs", poll_interval=0.1, clock=clock or time.monotonic
    ) as running:
        yield running


START_METHODS = ["forkserver", "spawn"]


@pytest.fixture(params=["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def controller(request: pytest.FixtureRequest) -> Any:
    """`controller(client, tmp_path, agent, **settings)`: a running controller, once with agents
    forked from the fork server and once with a fresh interpreter per agent. The spawn runs are
    `slow` (the fast lane keeps the forkserver ones) except where a test asks for both with
    `@pytest.mark.parametrize("controller", START_METHODS, indirect=True)`."""
    return functools.partial(run_controller, start_method=request.param)


async def enqueue(client: GatewayClient, prefix: str, input: Any = None, **fields: Any) -> str:
    rollout_id = new_id(prefix)
    await client.enqueue([RolloutCreate(rollout_id=rollout_id, input=input or {}, **fields)])
    return rollout_id


@pytest.mark.parametrize("controller", START_METHODS, indirect=True)  # spawn in the fast lane too
async def test_success_reports_reward_sync_and_async_agents(
    client: GatewayClient, tmp_path: Path, controller: Any
) -> None:
    async with controller(client, tmp_path, "RewardAgent"):
        sync_id = await enqueue(client, "ok", {"reward": 0.75})
        async_id = await enqueue(client, "ok-async", config={"local": {"agent_class": f"{AGENTS}:AsyncRewardAgent"}})
        done = await wait_for_rollout(client, sync_id)
        done_async = await wait_for_rollout(client, async_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    assert [(a.attempt_id, a.state) for a in done.attempts] == [("a1", RolloutState.SUCCEEDED)]
    assert (await client.triplets(sync_id)).reward == 0.75
    assert done_async.state == RolloutState.SUCCEEDED, done_async.status
    assert (await client.triplets(async_id)).reward == 0.5
    assert (tmp_path / "logs" / f"{sync_id}.a1.log").exists()


async def test_agent_lightning_dotted_class_runs(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    async with controller(client, tmp_path, "RewardAgent", local={"agent_class": f"{AGENTS}.RewardAgent"}):
        rollout_id = await enqueue(
            client, "dotted", {"reward": 0.25}, config={"local": {"agent_class": f"{AGENTS}.AsyncRewardAgent"}}
        )
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    assert (await client.triplets(rollout_id)).reward == 0.5  # the rollout's own class ran


async def test_non_daemon_threads_finish_before_the_agent_exits(
    client: GatewayClient, tmp_path: Path, controller: Any
) -> None:
    async with controller(client, tmp_path, "ThreadedAgent"):
        rollout_id = await enqueue(client, "thread")
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    assert (await client.triplets(rollout_id)).reward == 0.25


async def test_nonzero_exit_fails_with_exit_code_and_log_tail(
    client: GatewayClient, tmp_path: Path, controller: Any
) -> None:
    async with controller(client, tmp_path, "FailingAgent"):
        rollout_id = await enqueue(client, "exit")
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.FAILED
    message = done.status.error_message or ""
    assert message.startswith("exit code 3")
    assert "about to fail" in message and "log line 29" in message
    assert "log line 5\n" not in message  # only the tail
    assert done.attempts[0].error_message == message


async def test_agent_killed_by_signal(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    async with controller(client, tmp_path, "SelfKillAgent"):
        rollout_id = await enqueue(client, "sigkill")
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.FAILED
    assert (done.status.error_message or "").startswith("killed by signal 9")
    assert "going down" in (done.status.error_message or "")


async def test_hanging_agent_times_out_and_is_killed(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    clock = HandClock()
    clock.hold()  # however long the agent takes to start, its 1 s budget is untouched
    async with controller(client, tmp_path, "SleepAgent", clock=clock, rollout_timeout_seconds=30):
        pid_file = tmp_path / "hang.pids"
        rollout_id = await enqueue(client, "hang", {"pid_file": str(pid_file)}, config={"timeout_seconds": 1.0})
        pids = await read_pids(pid_file)
        clock.advance(2.0)  # twice its budget
        done = await wait_for_rollout(client, rollout_id)
        assert done.state == RolloutState.FAILED
        assert (done.status.error_message or "").startswith("timeout"), done.status
        # The controller reports the timeout once the group is gone; the wait only absorbs reaping.
        await wait_gone(pids, timeout=5.0)
    assert_group_gone(pids[0])


@pytest.mark.slow
async def test_paused_time_does_not_count(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    # A 2 s timeout and a 4 s pause: the attempt survives only if the pause does not count.
    # The controller's clock runs only from just after the pause began until just after it
    # ended, so how long the agent takes to start and to finish (on a busy machine) is no part
    # of the budget: the active time is a few milliseconds, against 4 s if the pause counted.
    started, go = tmp_path / "paused.started", tmp_path / "paused.go"
    clock = HandClock()
    clock.hold()
    async with controller(client, tmp_path, "GatedAgent", clock=clock):
        rollout_id = await enqueue(
            client, "paused", {"started": str(started), "go": str(go)}, config={"timeout_seconds": 2.0}
        )
        await wait_for_file(started)
        await client.pause(reason="test update")
        clock.release()
        await asyncio.sleep(4.0)
        await client.resume()
        clock.hold()
        go.touch()
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.SUCCEEDED, done.status


async def test_failed_attempt_is_retried_and_events_of_both_kept(
    client: GatewayClient, tmp_path: Path, controller: Any
) -> None:
    async with controller(client, tmp_path, "FlakyAgent", max_attempts=2):
        rollout_id = await enqueue(client, "flaky")
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    assert [(a.attempt_id, a.state) for a in done.attempts] == [
        ("a1", RolloutState.FAILED),
        ("a2", RolloutState.SUCCEEDED),
    ]
    assert (done.attempts[0].error_message or "").startswith("exit code 1")
    notes = await client.events(rollout_id, event_type="note")
    assert [(e.attempt_id, e.data["attempt"]) for e in notes] == [("a1", "a1"), ("a2", "a2")]
    assert (await client.triplets(rollout_id)).reward == 1.0


async def test_last_attempt_failure_fails_the_rollout(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    async with controller(client, tmp_path, "FailingAgent", max_attempts=2):
        rollout_id = await enqueue(client, "fail-twice")
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.FAILED
    assert [a.attempt_id for a in done.attempts] == ["a1", "a2"]


async def test_abort_and_delete_kill_the_agent_promptly(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    async with controller(client, tmp_path, "SleepAgent") as running:
        abort_pids, delete_pids = tmp_path / "abort.pids", tmp_path / "delete.pids"
        aborted = await enqueue(client, "abort", {"pid_file": str(abort_pids)})
        deleted = await enqueue(client, "delete", {"pid_file": str(delete_pids)})
        pids, other = await read_pids(abort_pids), await read_pids(delete_pids)
        await client.update_status(aborted, state=RolloutState.FAILED, error_message="aborted: test")
        await client.delete_rollout(deleted)
        # Promptly: within a few ticks and the kill grace, not when the agents end (120 s) or time out.
        await wait_gone(pids + other, timeout=10.0)
        await wait_until(lambda: not {aborted, deleted} & set(running.running))  # the controller is done with them
        after = await client.get_rollout(aborted)
        assert after.state == RolloutState.FAILED and after.status.error_message == "aborted: test"
    assert_group_gone(pids[0])
    assert_group_gone(other[0])


async def test_env_contract_and_env_map(
    client: GatewayClient, tmp_path: Path, gateway: GatewayThread, controller: Any
) -> None:
    env_map = {"QUESTION": "input.question", "META": "input.meta", "FIRST": "input.items.0", "COUNT": "input.n"}
    standard = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "DISABLE_TELEMETRY"]
    extra = [*env_map, "RUN_SETTING", *standard, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]
    # `env` is for every agent; it cannot replace the contract's own variables, and it wins over
    # the standard variables harnesses read
    own = {"RUN_SETTING": "on", "AGL_KEY": "forged", "QUESTION": "lost", "DISABLE_TELEMETRY": "0"}
    local = {"env_map": env_map, "env": own}
    async with controller(client, tmp_path, "EnvAgent", local=local, max_attempts=3):
        input = {"question": "2+2?", "meta": {"a": [1, 2]}, "items": ["x", "y"], "n": 4, "extra": extra}
        train_id = await enqueue(client, "env", input)
        val_id = await enqueue(client, "env-val", input, is_train=False)
        missing_id = await enqueue(client, "env-missing", {"extra": extra})
        done = await wait_for_rollout(client, train_id)
        assert (await wait_for_rollout(client, val_id)).state == RolloutState.SUCCEEDED
        missing = await wait_for_rollout(client, missing_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    [event] = await client.events(train_id, event_type="env")
    env = event.data
    assert env["AGL_OPENAI_BASE_URL"] == f"{gateway.url}/proxy/rollout/{train_id}/attempt/a1/mode/train/openai/v1"
    assert env["AGL_EVENT_URL"] == f"{gateway.url}/api/rollouts/{train_id}/attempt/a1/events"
    assert env["AGL_KEY"] == client.scoped_key(train_id, "a1")
    assert (env["AGL_ROLLOUT_ID"], env["AGL_ATTEMPT_ID"]) == (train_id, "a1")
    assert json.loads(env["AGL_ROLLOUT_INPUT"]) == input
    assert env["QUESTION"] == "2+2?" and env["FIRST"] == "x" and env["COUNT"] == "4"
    assert env["RUN_SETTING"] == "on"
    assert json.loads(env["META"]) == {"a": [1, 2]}
    assert env["cwd"] == os.getcwd()
    # Unchanged harnesses find the attempt's proxy through the standard variables.
    proxy = f"{gateway.url}/proxy/rollout/{train_id}/attempt/a1/mode/train"
    assert env["OPENAI_BASE_URL"] == proxy + "/openai/v1" and env["ANTHROPIC_BASE_URL"] == proxy + "/anthropic"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == env["AGL_KEY"]
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_TELEMETRY"] == "0"
    [val_event] = await client.events(val_id, event_type="env")
    assert "/mode/val/" in val_event.data["AGL_OPENAI_BASE_URL"]
    assert val_event.data["ANTHROPIC_BASE_URL"].endswith("/mode/val/anthropic")
    # A path the input lacks fails the rollout at once: another attempt would fail the same way.
    assert missing.state == RolloutState.FAILED
    assert "input.question" in (missing.status.error_message or "")
    assert len(missing.attempts) == 1


@pytest.mark.parametrize(
    "agent_class, fragment",
    [
        ("tests.controller.agents:Nope", "has no attribute"),
        ("no_such_module_xyz:Agent", "cannot import module"),
        ("tests.controller.agents.Nope", "has no attribute"),  # Agent Lightning's dotted form
        ("no_such_module_xyz.Agent", "cannot import module"),
        ("tests.controller.agents:NoRun", "no run() method"),
        (None, "must be set"),
    ],
)
async def test_bad_agent_class_is_a_clear_error_at_construction(
    client: GatewayClient, agent_class: str | None, fragment: str
) -> None:
    config = make_config(local={"agent_class": agent_class})
    with pytest.raises(ControllerConfigError) as info:
        Controller(config, client)
    assert "agentlightning.local.agent_class" in str(info.value)
    assert fragment in str(info.value)
    assert isinstance(info.value, (ValueError, ConfigError))


async def test_stop_kills_every_agent_and_requeues_its_rollout(
    client: GatewayClient, tmp_path: Path, controller: Any
) -> None:
    pid_files = [tmp_path / f"stop{i}.pids" for i in range(3)]
    async with controller(client, tmp_path, "SleepAgent") as running:
        ids = [await enqueue(client, "stop", {"pid_file": str(path)}) for path in pid_files]
        pids = [pid for path in pid_files for pid in await read_pids(path)]
        assert set(running.running) == set(ids)
    assert not any(alive(pid) for pid in pids)
    for path in pid_files:
        assert_group_gone(int(path.read_text().split()[0]))
    for rollout_id in ids:
        rollout = await client.get_rollout(rollout_id)
        assert rollout.state == RolloutState.QUEUING
        assert (rollout.attempts[0].error_message or "").startswith("interrupted")
        await client.update_status(rollout_id, state=RolloutState.FAILED, error_message="aborted: test over")


async def test_max_concurrency_is_respected(client: GatewayClient, tmp_path: Path, controller: Any) -> None:
    async with controller(client, tmp_path, "RewardAgent", local={"max_concurrency": 2}) as running:
        ids = [await enqueue(client, "conc", {"sleep": 0.3}) for _ in range(4)]
        peak = 0
        while True:
            rollouts = await client.list_rollouts(rollout_ids=ids)
            if all(r.state.terminal for r in rollouts):
                break
            assert sum(r.state == RolloutState.RUNNING for r in rollouts) <= 2
            peak = max(peak, len(running.running))
            await asyncio.sleep(0.05)
    assert peak == 2


async def test_controller_rides_out_a_gateway_that_starts_late(
    tmp_path: Path, controller: Any, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    # No retries in the client: the controller's own loop is what rides the wait out here.
    async with GatewayClient(f"http://127.0.0.1:{port}", ADMIN_KEY, retry_seconds=0) as late_client:
        async with controller(late_client, tmp_path, "RewardAgent"):
            await wait_until(lambda: sum("tick failed" in r.getMessage() for r in caplog.records) >= 2)
            with GatewayThread(admin_key=ADMIN_KEY, port=port):
                rollout_id = await enqueue(late_client, "late")
                done = await wait_for_rollout(late_client, rollout_id)
                assert done.state == RolloutState.SUCCEEDED, done.status


@pytest.mark.slow
def test_cli_controller_stops_its_agents_on_sigterm(gateway: GatewayThread, tmp_path: Path) -> None:
    import httpx

    run = cli_controller_with_an_agent(
        gateway, tmp_path / "cli.pids", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    with run as (process, rollout_id, pids):
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, process.stdout.read().decode() if process.stdout else ""
        assert not any(alive(pid) for pid in pids)
        rollout = httpx.get(
            f"{gateway.url}/api/rollouts/{rollout_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()
        assert rollout["status"]["state"] == "queuing"


def test_cli_rejects_a_bad_agent_class(gateway: GatewayThread) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollover.cli.main",
            "controller",
            "--gateway",
            gateway.url,
            "--key",
            ADMIN_KEY,
            "agentlightning.local.agent_class=no_such_module_xyz:Agent",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode in (1, 2)
    assert "agentlightning.local.agent_class" in result.stderr


def test_cli_rejects_a_wrong_admin_key(gateway: GatewayThread) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollover.cli.main",
            "controller",
            "--gateway",
            gateway.url,
            "--key",
            "wrong",
            f"agentlightning.local.agent_class={AGENTS}:RewardAgent",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--key" in result.stderr
