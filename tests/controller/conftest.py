from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from rollover.config import AgentLightningConfig, validate_config
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.processes import group_members
from rollover.store.models import Rollout
from tests.conftest import ADMIN_KEY


@pytest.fixture
async def client(gateway: GatewayThread) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(gateway.url, ADMIN_KEY) as gateway_client:
        yield gateway_client


class HandClock:
    """The controller's clock for timeout tests: real time that a test can hold still (so a
    slow agent start costs no budget) and move forward by hand."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._held_at: float | None = None

    def __call__(self) -> float:
        return self._held_at if self._held_at is not None else time.monotonic() + self._offset

    def hold(self) -> None:
        self._held_at = self()

    def release(self) -> None:
        if self._held_at is not None:
            self._offset = self._held_at - time.monotonic()
            self._held_at = None

    def advance(self, seconds: float) -> None:
        if self._held_at is not None:
            self._held_at += seconds
        else:
            self._offset += seconds


def cli_controller(gateway_url: str, agent_class: str, *overrides: str) -> list[str]:
    """The command line of `rollover controller` with the local runner and `agent_class`."""
    return [
        sys.executable,
        "-m",
        "rollover.cli.main",
        "controller",
        "--gateway",
        gateway_url,
        "--key",
        ADMIN_KEY,
        "--runner",
        "local",
        f"agentlightning.local.agent_class={agent_class}",
        *overrides,
    ]


def make_config(**agentlightning: Any) -> AgentLightningConfig:
    return validate_config({"agentlightning": agentlightning}).agentlightning


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def wait_for_rollout(
    client: GatewayClient, rollout_id: str, predicate: Any = None, timeout: float = 20.0
) -> Rollout:
    predicate = predicate or (lambda r: r.state.terminal)
    deadline = time.monotonic() + timeout
    while True:
        rollout = await client.get_rollout(rollout_id)
        if predicate(rollout):
            return rollout
        if time.monotonic() > deadline:
            raise AssertionError(f"rollout {rollout_id} still {rollout.state.value}: {rollout.status}")
        await asyncio.sleep(0.05)


async def wait_until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        await asyncio.sleep(0.05)


async def wait_for_file(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"the agent never wrote {path}")
        await asyncio.sleep(0.05)


async def read_pids(path: Path, timeout: float = 20.0) -> list[int]:
    await wait_for_file(path, timeout)
    return [int(p) for p in path.read_text().split()]


def alive(pid: int) -> bool:
    """Running and not a zombie (orphaned zombies wait for init, which may be slow)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def wait_gone(pids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while any(alive(pid) for pid in pids):
        if time.monotonic() - started > timeout:
            survivors = [pid for pid in pids if alive(pid)]
            raise AssertionError(f"processes {survivors} still alive after {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def assert_group_gone(pgid: int) -> None:
    assert group_members(pgid) == set(), f"process group {pgid} still has members"
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return
    # Only zombies left (init reaps orphans lazily): nothing is running.


@contextmanager
def cli_controller_with_an_agent(
    gateway: GatewayThread, pid_file: Path, **popen: Any
) -> Iterator[tuple[subprocess.Popen[bytes], str, list[int]]]:
    """`rollover controller` (`cli_controller`, unsandboxed) as a process of its own, running one
    `SleepAgent` rollout: yields the process, the rollout id and the agent's pids (its
    `pid_file`), once the agent runs. On exit the process is killed if it still runs (its
    session too with `start_new_session`), and the rollout is marked failed so no other test's
    controller picks it up."""
    import httpx

    rollout_id = new_id(pid_file.stem)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(
        f"{gateway.url}/api/rollouts",
        json=[{"rollout_id": rollout_id, "input": {"pid_file": str(pid_file)}}],
        headers=headers,
    ).raise_for_status()
    command = cli_controller(gateway.url, "tests.controller.agents:SleepAgent", "agentlightning.local.sandbox=false")
    process = subprocess.Popen(command, **{"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, **popen})
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists():
            output = process.stdout.read().decode() if process.poll() is not None and process.stdout else ""
            assert process.poll() is None, f"the controller exited: {output}"
            assert time.monotonic() < deadline, "the agent never started"
            time.sleep(0.05)
        time.sleep(0.1)
        yield process, rollout_id, [int(p) for p in pid_file.read_text().split()]
    finally:
        if process.poll() is None:
            if popen.get("start_new_session"):
                os.killpg(process.pid, 9)
            else:
                process.kill()
            process.wait()
        httpx.patch(
            f"{gateway.url}/api/rollouts/{rollout_id}",
            json={"status": {"state": "failed", "error_message": "aborted: test over"}},
            headers=headers,
        )
