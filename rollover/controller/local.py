"""Local runner: one child process per attempt, in its own process group.

Each agent runs `rollover.controller.agent_main pkg.mod:Class` in the controller's cwd with
that cwd on PYTHONPATH, output to `<log_dir>/<rollout id>.<attempt id>.log`: forked from the
fork server (`forkserver.py`, which has imported the agent SDK once) or, with
`agentlightning.local.start_method: spawn`, as a fresh interpreter. A process group per agent
lets the controller stop the agent together with anything it spawned (tool sandboxes,
servers); Linux kills the agent if the controller dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from rollover.config import LocalRunnerConfig
from rollover.controller.agent_main import PARENT_PID_ENV, AgentClassError, load_agent_class
from rollover.controller.forkserver import ForkServerClient, ForkServerError
from rollover.controller.runner import ControllerConfigError, LaunchError, LaunchSpec, Outcome
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

    def __init__(self, config: LocalRunnerConfig, *, log_dir: Path, cwd: Path, kill_grace_seconds: float = 2.0) -> None:
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
        self.fork_server = (
            ForkServerClient(list(config.preload_modules), log_path=log_dir / "forkserver.log", cwd=cwd)
            if config.start_method == "forkserver"
            else None
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
        if self.fork_server is not None:
            await self.fork_server.start()

    async def stop(self) -> None:
        live = list(self._live)
        if live:
            await asyncio.gather(*(execution.kill() for execution in live), return_exceptions=True)
        if self.fork_server is not None:
            await self.fork_server.stop()

    def claim_budget(self, horizon_seconds: float) -> int:
        return sys.maxsize

    async def extend_deadline(self, execution: object, seconds: float) -> None:
        return None  # the controller's own deadline is the only one

    def _child_env(self, spec: LaunchSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.defaults)
        env.update(self.config.env)
        env.update(spec.env)
        paths = [str(self.cwd)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
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
        with open(log_path, "ab") as log_file:
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
