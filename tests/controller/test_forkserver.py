"""The fork server the local runner starts agents from: crashes on either side leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from rollover.controller import Controller
from rollover.controller.forkserver import ForkServerClient
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.processes import child_pids
from rollover.store.models import RolloutCreate, RolloutState
from tests.controller.conftest import (
    alive,
    cli_controller_with_an_agent,
    make_config,
    new_id,
    read_pids,
    wait_for_rollout,
    wait_gone,
    wait_until,
)

AGENTS = "tests.controller.agents"


def fork_servers_of(parent_pid: int) -> list[int]:
    """Fork servers started by `parent_pid` (its agents, forks of a server, share the argv)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"rollover.controller.forkserver" in argv and ppid == parent_pid and alive(int(entry)):
            found.append(int(entry))
    return found


async def test_a_dead_fork_server_fails_its_agents_and_is_restarted(client: GatewayClient, tmp_path: Path) -> None:
    config = make_config(local={"agent_class": f"{AGENTS}:SleepAgent", "sandbox": False})
    async with Controller(config, client, log_dir=tmp_path / "logs", poll_interval=0.1):
        [server] = fork_servers_of(os.getpid())
        pid_file = tmp_path / "victim.pids"
        victim = new_id("victim")
        await client.enqueue([RolloutCreate(rollout_id=victim, input={"pid_file": str(pid_file)})])
        pids = await read_pids(pid_file)
        assert os.getpgid(pids[0]) == pids[0]  # the agent leads its own group
        os.kill(server, signal.SIGKILL)
        done = await wait_for_rollout(client, victim)
        assert done.state == RolloutState.FAILED
        assert "fork server" in (done.status.error_message or "")
        await wait_gone(pids, timeout=5.0)  # the agent and its grandchild die with the server
        # The next attempt gets a new server.
        after = new_id("after")
        await client.enqueue(
            [RolloutCreate(rollout_id=after, input={"pid_file": str(tmp_path / "after.pids"), "seconds": 0})]
        )
        assert (await wait_for_rollout(client, after)).state == RolloutState.SUCCEEDED
        [restarted] = fork_servers_of(os.getpid())
        assert restarted != server
    assert fork_servers_of(os.getpid()) == []  # the controller stops its server on exit


@pytest.mark.slow
def test_kill_9_of_the_controller_takes_the_fork_server_and_agents_down(gateway: GatewayThread, tmp_path: Path) -> None:
    with cli_controller_with_an_agent(gateway, tmp_path / "orphan.pids") as (process, _, agents):
        servers = fork_servers_of(process.pid)
        assert len(servers) == 1
        process.kill()
        process.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in servers + agents):
            assert time.monotonic() < deadline, f"left running: {[p for p in servers + agents if alive(p)]}"
            time.sleep(0.05)


async def test_an_agent_whose_launch_was_called_off_does_not_live_on(tmp_path: Path) -> None:
    # An attempt stopped while its launch waits for the fork server (a timeout, an abort) must
    # not leave behind the agent the server forks a moment later.
    server = ForkServerClient([], log_path=tmp_path / "forkserver.log", cwd=Path.cwd())
    await server.start()
    assert server.process is not None
    try:

        def request(name: str) -> tuple[str, dict[str, str], Path, Path]:
            env = dict(os.environ, AGL_ROLLOUT_INPUT=json.dumps({"pid_file": str(tmp_path / f"{name}.pids")}))
            return f"{AGENTS}:SleepAgent", env, Path.cwd(), tmp_path / f"{name}.log"

        called_off = asyncio.create_task(server.spawn(*request("called-off")))
        await asyncio.sleep(0)  # the request is on its way; its reply is not
        called_off.cancel()
        # The server answers in order: once the next agent is up, the first was forked too.
        kept, _ = await server.spawn(*request("kept"))
        await wait_until(lambda: set(child_pids(server.process.pid)) - {kept} == set(), timeout=10)
        await read_pids(tmp_path / "kept.pids")  # the agent that was asked for runs
    finally:
        await server.stop()


class _FakeServerProcess:
    """The fork server's pipes, scripted: every request is answered with its pid (a pidfd of
    this process on the fd socket, 4242 in the reply) and, in the same read, the agent's exit
    (an agent that dies at once)."""

    returncode = None

    def __init__(self, fd_socket: socket.socket) -> None:
        self.stdout = asyncio.StreamReader()
        self.stdin = self
        self.fd_socket = fd_socket

    def write(self, data: bytes) -> None:
        request = json.loads(data)
        tag, fds, _, _ = socket.recv_fds(self.fd_socket, 256, 1)  # the log file, sent first
        assert tag.decode() == str(request["id"]) and len(fds) == 1
        os.close(fds[0])
        pidfd = os.pidfd_open(os.getpid())
        socket.send_fds(self.fd_socket, [str(request["id"]).encode()], [pidfd])
        os.close(pidfd)
        self.stdout.feed_data(
            json.dumps({"id": request["id"], "pid": 4242}).encode() + b"\n" + b'{"exit": 4242, "returncode": 3}\n'
        )

    async def drain(self) -> None:
        await asyncio.sleep(0.05)  # the reader sees both lines before spawn() looks again


async def test_an_agent_that_exits_before_its_reply_is_seen_still_reports_its_exit(tmp_path: Path) -> None:
    fork_client = ForkServerClient([], log_path=tmp_path / "fork.log", cwd=tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    process = _FakeServerProcess(theirs)
    fork_client.process = process  # type: ignore[assignment]
    fork_client._fd_socket = ours
    ready = asyncio.get_running_loop().create_future()
    fork_client._reader = asyncio.get_running_loop().create_task(fork_client._read(process, ready))  # type: ignore[arg-type]
    pid, exited = await fork_client.spawn("agents:Quick", {}, tmp_path, tmp_path / "agent.log")
    assert pid == os.getpid()  # the pid the pidfd names, in the controller's PID namespace
    assert await asyncio.wait_for(exited, 10) == 3
    fork_client._reader.cancel()
