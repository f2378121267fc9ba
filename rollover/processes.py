"""Child-process hygiene shared by everything Rollover spawns (gateway, vLLM, agents)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


# Loaded once here: loading a library in a forked child of a threaded parent can deadlock.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """`preexec_fn`: ask Linux to send `sig` (SIGKILL) to the child when its parent dies, so
    a crashed trainer leaves no orphaned engines or agents behind. The signal is tied to the
    thread that forks, so spawn from threads that live as long as the parent (the main one)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig)


def exit_if_orphaned(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child, first thing: get `sig` when `parent_pid` (which started this process) dies,
    and exit now if it is already gone. The same guarantee as `die_with_parent` without a
    `preexec_fn`, which forces Python to copy the whole parent with fork() instead of
    spawning a small child, a cost the parent pays per child (~0.4 s for a trainer)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:
        os._exit(1)


def set_process_name(name: str) -> None:
    """The name `ps -o comm` and `top` show (Linux keeps 15 bytes of it)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_NAME, name.encode()[:15])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_taken(host: str, port: int) -> bool:
    """True if a server listens on `port` now (binding it fails as a server's bind would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def tail_lines(path: str | Path, n: int = 40, max_bytes: int = 65536) -> str:
    """The last `n` lines of a log file (what error messages quote), reading at most its
    last `max_bytes`."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - max_bytes))
            data = handle.read()
    except OSError as exc:
        return f"<log unreadable: {exc}>"
    return "".join(data.decode("utf-8", errors="replace").splitlines(keepends=True)[-n:])


def _process_table() -> list[tuple[int, int, int, bytes]]:
    """(pid, ppid, pgid, state) of every process, from /proc (empty where there is none)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    table = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The fields after the command name, which is parenthesised and may hold spaces.
        fields = stat[stat.rfind(b")") + 2 :].split()
        table.append((int(entry), int(fields[1]), int(fields[2]), fields[0]))
    return table


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid`."""
    return sorted(child for child, parent, _, _ in _process_table() if parent == pid)


def descendant_pids(pid: int) -> set[int]:
    """All live descendants of `pid`."""
    children: dict[int, list[int]] = {}
    for child, parent, _, _ in _process_table():
        children.setdefault(parent, []).append(child)
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
        return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> set[int]:
    """Live (non-zombie) processes of process group `pgid`. Orphaned zombies linger until
    init reaps them (in a container whose PID 1 does not reap, forever); they hold nothing."""
    return {pid for pid, _, group, state in _process_table() if group == pgid and state != b"Z"}


def group_alive(pgid: int) -> bool:
    """True while a live process is left in process group `pgid`."""
    if os.path.isdir("/proc"):
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    """`killpg`, quiet when the group is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(process: subprocess.Popen, pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        process.poll()  # reap the leader, or the group never looks empty
        if not group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def kill_group(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the child's process group (it must have been started with
    `start_new_session=True`), SIGKILL whatever is left after `grace` seconds, and reap."""
    pgid = process.pid
    signal_group(pgid, signal.SIGTERM)
    if not _wait_group_gone(process, pgid, grace):
        signal_group(pgid, signal.SIGKILL)
        _wait_group_gone(process, pgid, 5.0)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def stop_supervised_group(process: subprocess.Popen, timeout: float) -> bool:
    """Stop a child that leads its own process group and stops the rest itself (a supervisor,
    started with `start_new_session=True`): SIGTERM to the leader alone (signalling the whole
    group at once makes its members race and log errors), SIGKILL to the group and to any
    descendant that left it after `timeout` seconds, then reap. True if it was gone in time."""
    pgid = process.pid  # start_new_session: the leader's pid is the group id
    family = descendant_pids(process.pid) | {process.pid}

    def gone() -> bool:
        return not group_alive(pgid) and not any(pid_alive(p) for p in family)

    try:
        os.kill(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while not gone() and time.monotonic() < deadline:
        process.poll()
        time.sleep(0.1)
    in_time = gone()
    signal_group(pgid, signal.SIGKILL)
    for pid in family:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    # Grandchildren are reaped by init; wait briefly so callers see them gone.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not gone():
        time.sleep(0.05)
    return in_time
