"""The agent sandbox as the controller runs it: what an agent's process sees, how it is
stopped, and what happens where the sandbox cannot start."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from rollover.controller import Controller, ControllerConfigError
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.store.models import RolloutCreate, RolloutState
from tests.controller.conftest import cli_controller, make_config, new_id, wait_for_rollout, wait_until

AGENTS = "tests.controller.agents"


def sandboxed(agent: str, **local: Any) -> Any:
    return make_config(local={"agent_class": f"{AGENTS}:{agent}", "sandbox": True, **local})


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
async def test_a_sandboxed_agent_sees_its_scratch_the_allowlisted_environment_and_the_gateway(
    client: GatewayClient, gateway: GatewayThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    for name, value in {"MASTER_ADDR": "10.0.0.1", "WANDB_API_KEY": "secret", "HF_TOKEN": "hf_secret"}.items():
        monkeypatch.setenv(name, value)
    extra = ["HOME", "TMPDIR", "PATH", "MASTER_ADDR", "WANDB_API_KEY", "HF_TOKEN", "RUN_SETTING"]
    config = sandboxed("EnvAgent", start_method=start_method, env={"RUN_SETTING": "on"})
    async with Controller(config, client, log_dir=tmp_path / "logs", poll_interval=0.1):
        rollout_id = new_id("env")
        await client.enqueue([RolloutCreate(rollout_id=rollout_id, input={"extra": extra})])
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    [event] = await client.events(rollout_id, event_type="env")
    env = event.data
    assert env["cwd"] == env["HOME"] == env["TMPDIR"] == "/tmp"  # its own scratch folder
    assert env["MASTER_ADDR"] is None and env["WANDB_API_KEY"] is None and env["HF_TOKEN"] is None
    assert env["PATH"] == os.environ["PATH"] and env["RUN_SETTING"] == "on"
    # The gateway, as the sandbox's bridge serves it on the agent's own loopback.
    port = gateway.url.rsplit(":", 1)[1]
    assert env["AGL_OPENAI_BASE_URL"].startswith(f"http://127.0.0.1:{port}/proxy/rollout/{rollout_id}/")
    log = (tmp_path / "logs" / f"{rollout_id}.a1.log").stat()
    assert log.st_mode & 0o777 == 0o600


async def test_an_aborted_sandboxed_agent_dies_with_everything_it_started(
    client: GatewayClient, tmp_path: Path
) -> None:
    marker = f"sandboxed-sleeper-{time.monotonic_ns()}"
    config = sandboxed("MarkedSleepAgent")
    async with Controller(config, client, log_dir=tmp_path / "logs", poll_interval=0.1) as running:
        rollout_id = new_id("sleep")
        await client.enqueue([RolloutCreate(rollout_id=rollout_id, input={"marker": marker})])
        await wait_until(lambda: len(processes_with(marker)) == 1, timeout=30)  # its tool, seen from the host
        await client.update_status(rollout_id, state=RolloutState.FAILED, error_message="aborted: test")
        await wait_until(lambda: rollout_id not in running.running, timeout=30)
        await wait_until(lambda: not processes_with(marker), timeout=10)


async def test_without_bubblewrap_the_controller_says_so_at_construction(
    client: GatewayClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(ControllerConfigError, match=r"agentlightning\.local\.sandbox.*sandbox=false"):
        Controller(sandboxed("RewardAgent"), client, log_dir=tmp_path / "logs")


async def test_a_kernel_that_refuses_the_namespaces_stops_the_controller_in_one_line(
    client: GatewayClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bubblewrap as it fails where user namespaces are off (a container without them).
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    controller = Controller(sandboxed("RewardAgent"), client, log_dir=tmp_path / "logs")
    with pytest.raises(ControllerConfigError) as refused:
        await controller.start()
    message = str(refused.value)
    assert "\n" not in message and "No permissions to create new namespace" in message
    assert "agentlightning.local.sandbox=false" in message


def test_kill_9_of_the_controller_takes_the_sandbox_and_its_agents_down(gateway: GatewayThread) -> None:
    import signal
    import subprocess

    import httpx

    from tests.conftest import ADMIN_KEY

    marker = f"orphaned-sleeper-{time.monotonic_ns()}"
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(
        f"{gateway.url}/api/rollouts",
        json=[{"rollout_id": new_id("orphan"), "input": {"marker": marker}}],
        headers=headers,
    ).raise_for_status()
    process = subprocess.Popen(
        cli_controller(gateway.url, f"{AGENTS}:MarkedSleepAgent"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not processes_with(marker):
            assert process.poll() is None and time.monotonic() < deadline, "the agent never started"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 15
        # The agents (and their tools) and the relay the controller started (which names it).
        while processes_with(marker) or processes_with(f"--parent-pid\0{process.pid}\0"):
            assert time.monotonic() < deadline, "the sandbox outlived its controller"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
