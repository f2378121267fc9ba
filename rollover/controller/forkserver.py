"""A pre-imported parent for local agent processes: each attempt is a fork, not a new interpreter.

A fresh interpreter that imports `openai`, `httpx` and `rollover.agent` costs an agent about
0.9 s of CPU before its first model call; with dozens of agents per step on a few cores that
start-up is most of a short rollout. The fork server imports those modules once, then forks
one child per attempt. The contract stays the same as a fresh process: one process per
attempt, leading its own session (so the controller can stop it with everything it
started), its own environment and working directory, output appended to its log file, exit
code 0 for success. When the controller dies, Linux signals the server, which kills its
agents' process groups; if the server itself is killed, Linux kills its agents.

Wire protocol, one JSON object per line: the controller writes
`{"id", "agent_class", "env", "cwd", "log_path"}` to the server's stdin; the server answers
`{"id", "pid"}` (or `{"id", "error"}`) and later `{"exit": pid, "returncode": rc}` on its
stdout, `rc` negative for a signal as in `subprocess`. Closing stdin stops the server, which
first kills the sessions of children still running.

The server is single-threaded on purpose: forking a process with other threads can leave a
child holding a lock forever.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import io
import json
import os
import selectors
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, TextIO

from rollover.processes import exit_if_orphaned, set_process_name, signal_group

# What every agent imports; the server imports it once so that its children need not.
DEFAULT_PRELOAD = ("openai", "rollover.agent")
_MAX_FD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict[str, Any], server_pid: int) -> int:
    """Become the agent described by `request`; returns the exit code (never raises)."""
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        exit_if_orphaned(server_pid)
        set_process_name("rollover-agent")  # for ps/top; the argv still reads like the server's
        os.closerange(3, _MAX_FD)  # the server's pipes and selector are not the agent's
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
        sys.stderr = io.TextIOWrapper(
            open(2, "wb", buffering=0, closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
        cwd = request["cwd"]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(request["env"])
        # What a fresh interpreter started in `cwd` with this PYTHONPATH would search first.
        extra = [cwd, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        sys.path[:0] = [p for p in extra if p not in sys.path]
        sys.argv = ["rollover.controller.agent_main", request["agent_class"]]
    except BaseException:
        traceback.print_exc()
        return 70
    from rollover.controller.agent_main import run_agent

    try:
        run_agent(request["agent_class"])
        # As a fresh interpreter would before exiting: wait for the agent's non-daemon threads.
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


class ForkServer:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.children: set[int] = set()

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def spawn(self, request: dict[str, Any]) -> None:
        server_pid = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request, server_pid))
        self.children.add(pid)
        self.send({"id": request.get("id"), "pid": pid})

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"exit": pid, "returncode": _returncode(status)})

    def kill_children(self) -> None:
        for pid in list(self.children):
            signal_group(pid, signal.SIGKILL)
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def serve(self, requests_fd: int) -> None:
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        selector = selectors.DefaultSelector()
        selector.register(requests_fd, selectors.EVENT_READ)
        selector.register(wake_read, selectors.EVENT_READ)
        pending = b""
        try:
            while True:
                for key, _ in selector.select():
                    if key.fd == wake_read:
                        try:
                            os.read(wake_read, 512)
                        except BlockingIOError:
                            pass
                        continue
                    chunk = os.read(requests_fd, 65536)
                    if not chunk:
                        return
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            self.handle(line)
                self.reap()
        finally:
            self.kill_children()
            selector.close()

    def handle(self, line: bytes) -> None:
        try:
            request = json.loads(line)
            missing = {"agent_class", "env", "cwd", "log_path"} - set(request)
            if missing:
                raise ValueError(f"missing fields {sorted(missing)}")
        except ValueError as exc:
            self.send({"id": None, "error": f"bad request: {exc}"})
            return
        try:
            self.spawn(request)
        except OSError as exc:
            self.send({"id": request.get("id"), "error": f"fork failed: {exc!r}"})


class ForkServerError(RuntimeError):
    """The fork server could not start an agent, or died."""


class ForkServerClient:
    """The controller's side: starts the server, asks it for agents, hands out exit futures.

    `spawn()` returns the agent's pid (which is also its process group and session id) and a
    future with its return code; the future resolves to None if the server died first (its
    children die with it)."""

    def __init__(self, preload: list[str], *, log_path: Path, cwd: Path) -> None:
        self.preload = preload
        self.log_path = log_path
        self.cwd = cwd
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._exits: dict[int, asyncio.Future[int | None]] = {}
        self._next_id = 0
        self._start_lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        return (
            self.process is not None
            and self.process.returncode is None
            and self._reader is not None
            and not self._reader.done()
        )

    async def start(self) -> None:
        async with self._start_lock:
            if self.running:
                return
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "rollover.controller.forkserver",
                    "--parent-pid",
                    str(os.getpid()),
                    *self.preload,
                    cwd=self.cwd,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                )
            self._reader = asyncio.get_running_loop().create_task(self._read(self.process))

    async def spawn(
        self, agent_class: str, env: dict[str, str], cwd: Path, log_path: Path
    ) -> tuple[int, asyncio.Future[int | None]]:
        await self.start()
        assert self.process is not None and self.process.stdin is not None
        self._next_id += 1
        request_id = self._next_id
        reply = asyncio.get_running_loop().create_future()
        self._replies[request_id] = reply
        request = {"id": request_id, "agent_class": agent_class, "env": env, "cwd": str(cwd), "log_path": str(log_path)}
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._replies.pop(request_id, None)
            raise ForkServerError(f"the fork server is gone ({exc!r}); see {self.log_path}") from exc
        try:
            answer = await asyncio.shield(reply)
        except asyncio.CancelledError:
            # The server forks the agent all the same; nobody would wait for it or stop it.
            reply.add_done_callback(_kill_unclaimed)
            raise
        if "error" in answer:
            raise ForkServerError(answer["error"])
        # The future itself, not a lookup: the exit may already have been read and popped.
        return int(answer["pid"]), answer["exit_future"]

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        loop = asyncio.get_running_loop()
        try:
            async for line in process.stdout:
                message = json.loads(line)
                if "exit" in message:
                    future = self._exits.pop(int(message["exit"]), None)
                    if future is not None and not future.done():
                        future.set_result(int(message["returncode"]))
                    continue
                if "pid" in message:
                    # Before the reply is seen: the exit may be the very next line.
                    message["exit_future"] = self._exits[int(message["pid"])] = loop.create_future()
                waiter = self._replies.pop(message.get("id"), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message)
        finally:
            error = ForkServerError(f"the fork server exited; see {self.log_path}")
            for waiter in self._replies.values():
                if not waiter.done():
                    waiter.set_exception(error)
            for future in self._exits.values():
                if not future.done():
                    future.set_result(None)
            self._replies.clear()
            self._exits.clear()

    async def stop(self, timeout: float = 10.0) -> None:
        """Close the server's stdin: it kills the agents still running and exits."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
        if self._reader is not None:
            await self._reader


def _kill_unclaimed(reply: asyncio.Future[dict[str, Any]]) -> None:
    if reply.cancelled() or reply.exception() is not None or "pid" not in reply.result():
        return
    pid = int(reply.result()["pid"])
    signal_group(pid, signal.SIGKILL)  # whatever it started already
    try:
        os.kill(pid, signal.SIGKILL)  # it may not lead its own group yet
    except ProcessLookupError:
        pass


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollover.controller.forkserver")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("preload", nargs="*", help="modules to import once for every agent")
    args = parser.parse_args(argv)
    # SIGTERM, not SIGKILL, when the controller dies: the server then kills its agents' whole
    # process groups (grandchildren included) before it goes.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    exit_if_orphaned(args.parent_pid, signal.SIGTERM)
    for module in (*DEFAULT_PRELOAD, *args.preload):
        try:
            importlib.import_module(module)
        except Exception as exc:
            print(f"forkserver: cannot preload {module!r}: {exc!r}", file=sys.stderr, flush=True)
    # Replies go to the real stdout; anything else printed here goes to stderr (the log).
    replies = sys.stdout
    sys.stdout = sys.stderr
    ForkServer(replies).serve(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
