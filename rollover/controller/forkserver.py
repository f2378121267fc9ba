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
`{"id", "agent_class", "env", "cwd"}` to the server's stdin, after sending the agent's open
log file on the fd socket (a datagram carrying the request id and the descriptor: the server
may not be able to open the run's folder itself, and the log is created 0600 by the
controller). The server sends back, on the fd socket, a pidfd of the agent (the controller
learns its pid from it, whatever PID namespace the server lives in), then answers
`{"id", "pid"}` (or `{"id", "error"}`) and later `{"exit": pid, "returncode": rc}` on its
stdout, `rc` negative for a signal as in `subprocess`; `pid` is the server's view of it.
`{"ready": true}` comes once, when the preloads are done. Closing stdin stops the server,
which first kills the sessions of children still running.

In the sandbox (`--sandbox`, the server runs under bubblewrap, see `sandbox.py`) each child
confines itself before the agent runs (`confine.py`), and the server starts the bridge to
the gateway (`bridge.py`). `--exec` starts a fresh interpreter in each (confined) child: the
`spawn` start method.

The server is single-threaded on purpose: forking a process with other threads can leave a
child holding a lock forever.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import importlib
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rollover.processes import exit_if_orphaned, set_process_name, signal_group

# What every agent imports; the server imports it once so that its children need not.
DEFAULT_PRELOAD = ("openai", "rollover.agent")
_MAX_FD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024
_FD_SOCKET_ARG = "--fd-socket"
# How long the controller waits for a new server's preloads (and sandbox) to be ready.
READY_TIMEOUT_SECONDS = 120.0


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@dataclass(frozen=True)
class ServerOptions:
    """How the server starts its agents: confined (`sandbox`: the paths under /tmp to bind
    back, the uid to drop to) and in-process or as a fresh interpreter (`exec_agents`)."""

    sandbox: bool = False
    keep: tuple[str, ...] = ()
    agent_uid: int | None = None
    exec_agents: bool = False
    bridge_port: int | None = None  # sandbox: the gateway's port, bridged on its loopback
    bridge_socket: str | None = None  # sandbox: the Unix socket that leads to the gateway


def _redirect_stdio(log_fd: int) -> None:
    """stdin from /dev/null, stdout and stderr to the log; nothing else of the server's open
    (its pipes and selector are not the agent's)."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, _MAX_FD)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )


def _child(request: dict[str, Any], log_fd: int, server_pid: int, options: ServerOptions) -> int:
    """Become the agent described by `request`; returns the exit code (never raises)."""
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        exit_if_orphaned(server_pid)
        set_process_name("rollover-agent")  # for ps/top; the argv still reads like the server's
        _redirect_stdio(log_fd)
        if options.sandbox:
            from rollover.controller.confine import confine_attempt

            waited = confine_attempt(list(options.keep), options.agent_uid)
            if waited is not None:
                return waited
        cwd = request["cwd"]
        if not options.sandbox:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(request["env"])
        if options.exec_agents:
            os.execve(
                sys.executable,
                [sys.executable, "-m", "rollover.controller.agent_main", request["agent_class"]],
                dict(os.environ),
            )
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


def _send_fd(sock: socket.socket, tag: str, fd: int) -> None:
    sock.sendmsg([tag.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


class ForkServer:
    def __init__(self, out: TextIO, fd_socket: socket.socket, options: ServerOptions) -> None:
        self.out = out
        self.fd_socket = fd_socket
        self.options = options
        self.children: set[int] = set()
        self._log_fds: dict[str, int] = {}  # request id -> its log file, sent ahead of it

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def _log_fd(self, request_id: str) -> int:
        """The log file sent for `request_id` (sent before the request, so already queued)."""
        while request_id not in self._log_fds:
            tag, fds, _, _ = socket.recv_fds(self.fd_socket, 256, 1)
            if not tag:
                raise ValueError("the controller closed the fd socket")
            if fds:
                self._log_fds[tag.decode()] = fds[0]
        return self._log_fds.pop(request_id)

    def spawn(self, request: dict[str, Any], log_fd: int) -> None:
        server_pid = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request, log_fd, server_pid, self.options))
        os.close(log_fd)
        self.children.add(pid)
        pidfd = os.pidfd_open(pid)
        try:
            _send_fd(self.fd_socket, str(request.get("id")), pidfd)
        finally:
            os.close(pidfd)
        self.send({"id": request.get("id"), "pid": pid})

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:
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
            missing = {"id", "agent_class", "env", "cwd"} - set(request)
            if missing:
                raise ValueError(f"missing fields {sorted(missing)}")
            log_fd = self._log_fd(str(request["id"]))
        except (ValueError, OSError) as exc:
            self.send({"id": None, "error": f"bad request: {exc}"})
            return
        try:
            self.spawn(request, log_fd)
        except OSError as exc:
            self.send({"id": request.get("id"), "error": f"fork failed: {exc!r}"})


class ForkServerError(RuntimeError):
    """The fork server could not start an agent, or died."""


def _pid_of(pidfd: int) -> int:
    """The pid a pidfd refers to, as this process's PID namespace numbers it."""
    with open(f"/proc/self/fdinfo/{pidfd}") as handle:
        for line in handle:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise ForkServerError("the fork server sent something that is not a pidfd")


class ForkServerClient:
    """The controller's side: starts the server, asks it for agents, hands out exit futures.

    `spawn()` returns the agent's pid (which is also its process group and session id) and a
    future with its return code; the future resolves to None if the server died first (its
    children die with it). `wrap` turns the server's command into the one to run (the
    sandbox's bubblewrap around it)."""

    def __init__(
        self,
        preload: list[str],
        *,
        log_path: Path,
        cwd: Path,
        options: ServerOptions | None = None,
        wrap: Any = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.preload = preload
        self.log_path = log_path
        self.cwd = cwd
        self.options = options or ServerOptions()
        self.wrap = wrap
        self.pass_fds = pass_fds
        self.process: asyncio.subprocess.Process | None = None
        self._fd_socket: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
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

    def _command(self, child_socket: int) -> list[str]:
        options = self.options
        command = [sys.executable, "-m", "rollover.controller.forkserver", _FD_SOCKET_ARG, str(child_socket)]
        # Inside a PID namespace the controller is no parent the server can see:
        # bubblewrap's --die-with-parent ends the sandbox with the controller instead.
        command += ["--parent-pid", "0" if options.sandbox else str(os.getpid())]
        if options.sandbox:
            command += ["--sandbox", *(arg for path in options.keep for arg in ("--keep", path))]
            if options.agent_uid is not None:
                command += ["--agent-uid", str(options.agent_uid)]
            if options.bridge_port is not None and options.bridge_socket:
                command += ["--bridge-port", str(options.bridge_port), "--bridge-socket", options.bridge_socket]
        if options.exec_agents:
            command.append("--exec")
        return [*command, "--", *self.preload]

    async def start(self) -> None:
        async with self._start_lock:
            if self.running:
                return
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            parent_socket, child_socket = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            command = self._command(child_socket.fileno())
            if self.wrap is not None:
                command = self.wrap(command)
            try:
                with open(self.log_path, "ab") as log:
                    self.process = await asyncio.create_subprocess_exec(
                        *command,
                        cwd=self.cwd,
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=log,
                        start_new_session=True,
                        pass_fds=(child_socket.fileno(), *self.pass_fds),
                    )
            finally:
                child_socket.close()
            parent_socket.setblocking(False)
            if self._fd_socket is not None:
                self._fd_socket.close()
            self._fd_socket = parent_socket
            self._ready = asyncio.get_running_loop().create_future()
            self._reader = asyncio.get_running_loop().create_task(self._read(self.process, self._ready))
            try:
                await asyncio.wait_for(asyncio.shield(self._ready), READY_TIMEOUT_SECONDS)
            except asyncio.TimeoutError:
                raise ForkServerError(
                    f"the fork server was not ready after {READY_TIMEOUT_SECONDS:g}s; see {self.log_path}"
                ) from None

    async def spawn(
        self, agent_class: str, env: dict[str, str], cwd: Path, log_path: Path
    ) -> tuple[int, asyncio.Future[int | None]]:
        await self.start()
        assert self.process is not None and self.process.stdin is not None and self._fd_socket is not None
        self._next_id += 1
        request_id = self._next_id
        reply = asyncio.get_running_loop().create_future()
        self._replies[request_id] = reply
        request = {"id": request_id, "agent_class": agent_class, "env": env, "cwd": str(cwd)}
        # Only the controller and the agent may read what an agent writes.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            _send_fd(self._fd_socket, str(request_id), log_fd)
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as exc:
            self._replies.pop(request_id, None)
            raise ForkServerError(f"the fork server is gone ({exc!r}); see {self.log_path}") from exc
        finally:
            os.close(log_fd)
        try:
            answer = await asyncio.shield(reply)
        except asyncio.CancelledError:
            # The server forks the agent all the same; nobody would wait for it or stop it.
            reply.add_done_callback(_kill_unclaimed)
            raise
        if "error" in answer:
            raise ForkServerError(answer["error"])
        # The future itself, not a lookup: the exit may already have been read and popped.
        return int(answer["host_pid"]), answer["exit_future"]

    def _receive_pid(self, request_id: Any) -> int:
        """The agent's pid as this process sees it, from the pidfd the server sent ahead of
        its reply (so it is already queued)."""
        assert self._fd_socket is not None
        while True:
            tag, fds, _, _ = socket.recv_fds(self._fd_socket, 256, 1)
            if not fds:
                continue
            try:
                if tag.decode() == str(request_id):
                    return _pid_of(fds[0])
            finally:
                os.close(fds[0])

    async def _read(self, process: asyncio.subprocess.Process, ready: asyncio.Future[None]) -> None:
        assert process.stdout is not None
        loop = asyncio.get_running_loop()
        try:
            async for line in process.stdout:
                message = json.loads(line)
                if "ready" in message:
                    if not ready.done():
                        ready.set_result(None)
                    continue
                if "exit" in message:
                    future = self._exits.pop(int(message["exit"]), None)
                    if future is not None and not future.done():
                        future.set_result(int(message["returncode"]))
                    continue
                if "pid" in message:
                    # Before the reply is seen: the exit may be the very next line.
                    message["exit_future"] = self._exits[int(message["pid"])] = loop.create_future()
                    message["host_pid"] = self._receive_pid(message.get("id"))
                waiter = self._replies.pop(message.get("id"), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message)
        finally:
            error = ForkServerError(f"the fork server exited; see {self.log_path}")
            if not ready.done():
                ready.set_exception(
                    ForkServerError(f"the fork server exited before it was ready: {_log_tail(self.log_path)}")
                )
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
        if self._fd_socket is not None:
            self._fd_socket.close()
            self._fd_socket = None


def _log_tail(path: Path) -> str:
    from rollover.processes import tail_lines

    tail = tail_lines(path, 5).strip()
    return " | ".join(tail.splitlines()) if tail else f"(nothing in {path})"


def _kill_unclaimed(reply: asyncio.Future[dict[str, Any]]) -> None:
    if reply.cancelled() or reply.exception() is not None or "host_pid" not in reply.result():
        return
    pid = int(reply.result()["host_pid"])
    signal_group(pid, signal.SIGKILL)  # whatever it started already
    try:
        os.kill(pid, signal.SIGKILL)  # it may not lead its own group yet
    except ProcessLookupError:
        pass


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _start_bridge(port: int, socket_path: str) -> None:
    """The sandbox's way to the gateway (`bridge.py`), listening before this server is ready."""
    from rollover.controller.bridge import listen_loopback

    listener = listen_loopback(port)
    subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollover.controller.bridge",
            "--listen-fd",
            str(listener.fileno()),
            "--unix",
            socket_path,
        ],
        pass_fds=(listener.fileno(),),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    listener.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollover.controller.forkserver")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies (0: do not watch)")
    parser.add_argument(_FD_SOCKET_ARG, type=int, required=True, help="datagram socket for log files and pidfds")
    parser.add_argument("--sandbox", action="store_true", help="confine each agent (see confine.py)")
    parser.add_argument("--keep", action="append", default=[], help="sandbox: a read-only path under /tmp to keep")
    parser.add_argument("--agent-uid", type=int, default=None, help="sandbox: the uid agents drop to")
    parser.add_argument("--bridge-port", type=int, default=None, help="sandbox: the gateway's port on loopback")
    parser.add_argument("--bridge-socket", default=None, help="sandbox: the Unix socket that leads to the gateway")
    parser.add_argument("--exec", action="store_true", help="a fresh interpreter per agent (spawn)")
    parser.add_argument("preload", nargs="*", help="modules to import once for every agent")
    args = parser.parse_args(argv)
    # SIGTERM, not SIGKILL, when the controller dies: the server then kills its agents' whole
    # process groups (grandchildren included) before it goes.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.parent_pid:
        exit_if_orphaned(args.parent_pid, signal.SIGTERM)
    if args.bridge_port is not None and args.bridge_socket:
        _start_bridge(args.bridge_port, args.bridge_socket)
    options = ServerOptions(
        sandbox=args.sandbox, keep=tuple(args.keep), agent_uid=args.agent_uid, exec_agents=args.exec
    )
    if not args.exec:
        for module in (*DEFAULT_PRELOAD, *args.preload):
            try:
                importlib.import_module(module)
            except Exception as exc:
                print(f"forkserver: cannot preload {module!r}: {exc!r}", file=sys.stderr, flush=True)
    # Replies go to the real stdout; anything else printed here goes to stderr (the log).
    replies = sys.stdout
    sys.stdout = sys.stderr
    server = ForkServer(replies, socket.socket(fileno=args.fd_socket), options)
    server.send({"ready": True})
    server.serve(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
