"""Child-process hygiene shared by everything Rollover spawns (gateway, vLLM, agents)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


# Loaded once here: loading a library in a forked child of a threaded parent can deadlock.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """`preexec_fn`: ask Linux to SIGKILL the child when its parent dies, so a crashed
    trainer leaves no orphaned engines or agents behind. The signal is tied to the thread
    that forks, so spawn from threads that live as long as the parent (the main one)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
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
    _signal_group(pgid, signal.SIGTERM)
    if not _wait_group_gone(process, pgid, grace):
        _signal_group(pgid, signal.SIGKILL)
        _wait_group_gone(process, pgid, 5.0)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
