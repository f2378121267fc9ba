"""Local runner: one child process per attempt, in its own process group.

Each agent runs `rollover.controller.agent_main pkg.mod:Class` in the controller's cwd with
that cwd on PYTHONPATH, output to `<log_dir>/<rollout id>.<attempt id>.log`: forked from the
fork server (`forkserver.py`, which has imported the agent SDK once) or, with
`agentlightning.local.start_method: spawn`, as a fresh interpreter. A process group per agent
lets the controller stop the agent together with anything it spawned (tool sandboxes,
servers); Linux kills the agent if the controller dies.

With `agentlightning.local.sandbox` (the default) the fork server runs in bubblewrap's
sandbox and confines every attempt it starts (`sandbox.py`, `confine.py`); both start
methods go through it (`spawn` then execs a fresh interpreter in the confined child), and
agents reach the gateway through the bridge (`bridge.py`) only. Either way an agent's
environment is an allowlist (`agent_env.base_env`) plus the env contract.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from rollover.config import LocalRunnerConfig
from rollover.controller.agent_env import base_env
from rollover.controller.agent_main import PARENT_PID_ENV, AgentClassError, load_agent_class
from rollover.controller.bridge import GatewayRelay
from rollover.controller.confine import SCRATCH
from rollover.controller.forkserver import ForkServerClient, ForkServerError, ServerOptions
from rollover.controller.runner import ControllerConfigError, LaunchError, LaunchSpec, Outcome
from rollover.controller.sandbox import (
    SOCKET_DIR,
    SOCKET_NAME,
    SandboxLayout,
    SandboxUnavailable,
    agent_uid,
    bwrap_command,
)
from rollover.processes import group_alive, group_members, signal_group, tail_lines

log = logging.getLogger("rollover.controller.local")

LOG_TAIL_LINES = 20


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-returncode} ({name})"
    return f"exit code {returncode}"


class LocalExecution:
    """One agent process, however it was started: `exited` resolves to its return code
    (None when its fork server died under it)."""

    job_name: str | None = None

    def __init__(self, pid: int, exited: asyncio.Future[int | None], log_path: Path, kill_grace_seconds: float) -> None:
        self.pid = pid
        self.pgid = pid  # the agent leads its own session and process group
        self.exited = exited
        self.log_path = log_path
        self.kill_grace_seconds = kill_grace_seconds
        self._kill_lock = asyncio.Lock()

    async def wait(self) -> Outcome:
        returncode = await asyncio.shield(self.exited)
        # Whatever the agent left running in its group goes with it.
        await self._clear_group()
        if returncode == 0:
            return Outcome(True)
        reason = "the fork server that started it died" if returncode is None else describe_exit(returncode)
        tail = tail_lines(self.log_path, LOG_TAIL_LINES).rstrip("\n")
        if tail:
            return Outcome(False, f"{reason}: last lines of {self.log_path}:\n{tail}")
        return Outcome(False, f"{reason} (log {self.log_path} is empty)")

    async def kill(self) -> None:
        async with self._kill_lock:
            if not self.exited.done():
                signal_group(self.pgid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(self.exited), self.kill_grace_seconds)
                except asyncio.TimeoutError:
                    pass
            await self._clear_group()

    async def _clear_group(self) -> None:
        if not group_alive(self.pgid):
            return
        signal_group(self.pgid, signal.SIGKILL)
        await asyncio.shield(self.exited)
        deadline = time.monotonic() + 5.0
        while group_members(self.pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


class LocalRunner:
    """Agents as local processes: forks of a pre-imported fork server (`start_method:
    forkserver`, the default) or fresh interpreters (`spawn`)."""

    def __init__(
        self,
        config: LocalRunnerConfig,
        *,
        log_dir: Path,
        cwd: Path,
        gateway_url: str,
        hidden_paths: tuple[Path, ...] = (),
        kill_grace_seconds: float = 2.0,
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        self.cwd = cwd
        self.kill_grace_seconds = kill_grace_seconds
        self._checked: dict[str, str | None] = {}  # agent class spec -> import error, if any
        self._live: set[LocalExecution] = set()
        self._reapers: set[asyncio.Task[int | None]] = set()
        if config.agent_class is None:
            raise ControllerConfigError(
                "agentlightning.local.agent_class must be set to 'pkg.module:Class' (or 'pkg.module.Class') for the local runner"
            )
        error = self._check_class(config.agent_class)
        if error:
            raise ControllerConfigError(f"agentlightning.local.agent_class: {error}")
        self._relay: GatewayRelay | None = None
        self._socket_dir: str | None = None
        self.agent_gateway_url: str | None = None
        self.fork_server: ForkServerClient | None = None
        if config.sandbox:
            self.fork_server = self._sandboxed_server(gateway_url, [log_dir, *hidden_paths])
        elif config.start_method == "forkserver":
            self.fork_server = ForkServerClient(
                list(config.preload_modules), log_path=log_dir / "forkserver.log", cwd=cwd
            )

    def _sandboxed_server(self, gateway_url: str, hidden: list[Path]) -> ForkServerClient:
        """The fork server in bubblewrap's sandbox, with the bridge to the gateway."""
        if shutil.which("bwrap") is None:
            raise ControllerConfigError(
                "agentlightning.local.sandbox: bubblewrap (bwrap) is not installed (Debian: apt-get install "
                "bubblewrap); set agentlightning.local.sandbox=false to run agents unsandboxed"
            )
        parts = urlsplit(gateway_url)
        port = parts.port or 80
        self._socket_dir = tempfile.mkdtemp(prefix="rollover-gateway-")  # 0700: the controller's only
        self._relay = GatewayRelay(
            parts.hostname or "127.0.0.1", port, Path(self._socket_dir) / SOCKET_NAME, self.log_dir / "bridge.log"
        )
        # Inside, the gateway is 127.0.0.1:<its port>, whatever address it has outside.
        self.agent_gateway_url = f"http://127.0.0.1:{port}"
        layout = SandboxLayout.build(self.cwd, hidden, Path(self._socket_dir))
        options = ServerOptions(
            sandbox=True,
            keep=tuple(layout.kept_under_scratch()),
            agent_uid=agent_uid(),
            exec_agents=self.config.start_method == "spawn",
            bridge_port=port,
            bridge_socket=f"{SOCKET_DIR}/{SOCKET_NAME}",
        )
        server_env = {**base_env(os.environ, home=SCRATCH), "PYTHONPATH": self._python_path(os.environ)}
        preload = list(self.config.preload_modules) if self.config.start_method == "forkserver" else []
        return ForkServerClient(
            preload,
            log_path=self.log_dir / "forkserver.log",
            cwd=self.cwd,
            options=options,
            wrap=lambda command: bwrap_command(layout, command, server_env),
        )

    def _check_class(self, spec: str) -> str | None:
        """Import the class here once, so a typo fails fast instead of in every agent."""
        if spec not in self._checked:
            # The agents run with the cwd on PYTHONPATH; look where they will look.
            if str(self.cwd) not in sys.path:
                sys.path.insert(0, str(self.cwd))
            try:
                load_agent_class(spec)
                self._checked[spec] = None
            except AgentClassError as exc:
                self._checked[spec] = str(exc)
        return self._checked[spec]

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._relay is not None:
            await self._relay.start()
        if self.fork_server is not None:
            try:
                await self.fork_server.start()
            except (ForkServerError, SandboxUnavailable) as exc:
                if self._relay is None:
                    raise
                await self.stop()
                raise ControllerConfigError(
                    f"agentlightning.local.sandbox: the agent sandbox cannot start here ({exc}); "
                    "set agentlightning.local.sandbox=false to run agents unsandboxed"
                ) from None

    async def stop(self) -> None:
        live = list(self._live)
        if live:
            await asyncio.gather(*(execution.kill() for execution in live), return_exceptions=True)
        if self.fork_server is not None:
            await self.fork_server.stop()
        if self._relay is not None:
            await self._relay.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def claim_budget(self, horizon_seconds: float) -> int:
        return sys.maxsize

    async def extend_deadline(self, execution: object, seconds: float) -> None:
        return None  # the controller's own deadline is the only one

    def _python_path(self, environ: dict[str, str] | os._Environ[str]) -> str:
        paths = [str(self.cwd)]
        if environ.get("PYTHONPATH"):
            paths.append(environ["PYTHONPATH"])
        return os.pathsep.join(paths)

    def _child_env(self, spec: LaunchSpec) -> dict[str, str]:
        """The allowlisted base, the harnesses' standard variables, `local.env`, the contract."""
        env = base_env(os.environ, home=SCRATCH if self.config.sandbox else None)
        env.update(spec.defaults)
        env.update(self.config.env)
        env.update(spec.env)
        env["PYTHONPATH"] = self._python_path({**os.environ, **self.config.env})
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def launch(self, spec: LaunchSpec) -> LocalExecution:
        agent_class = spec.rollout.config.local.agent_class or self.config.agent_class
        assert agent_class is not None
        error = self._check_class(agent_class)
        if error:
            raise LaunchError(f"agent class: {error}", permanent=True)
        log_path = self.log_dir / f"{spec.rollout_id}.{spec.attempt_id}.log"
        env = self._child_env(spec)
        try:
            if self.fork_server is not None:
                pid, exited = await self.fork_server.spawn(agent_class, env, self.cwd, log_path)
            else:
                pid, exited = await self._spawn(agent_class, env, log_path)
        except (OSError, ForkServerError) as exc:
            raise LaunchError(f"cannot start the agent process: {exc}") from exc
        execution = LocalExecution(pid, exited, log_path, self.kill_grace_seconds)
        self._live.add(execution)
        exited.add_done_callback(lambda _: self._live.discard(execution))
        log.debug("rollout %s attempt %s: pid %d, log %s", spec.rollout_id, spec.attempt_id, pid, log_path)
        return execution

    async def _spawn(
        self, agent_class: str, env: dict[str, str], log_path: Path
    ) -> tuple[int, asyncio.Future[int | None]]:
        """A fresh interpreter. No `preexec_fn`: it would make Python fork the whole
        controller process; the agent asks for its parent-death signal itself."""
        env[PARENT_PID_ENV] = str(os.getpid())
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with open(log_fd, "ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "rollover.controller.agent_main",
                agent_class,
                cwd=self.cwd,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        exited: asyncio.Task[int | None] = asyncio.get_running_loop().create_task(process.wait())
        self._reapers.add(exited)
        exited.add_done_callback(self._reapers.discard)
        return process.pid, exited
