"""What one sandboxed attempt does to itself before its agent code runs, inside the sandbox
that bubblewrap made for the fork server (`sandbox.py`).

The fork server holds the namespaced capabilities bubblewrap left it; each attempt, forked
from it, takes a mount and a PID namespace of its own, then gives every capability up:

- its own PID namespace: it is PID 1 there and sees no other process (no other agent's
  `/proc/PID/environ`, not the fork server or its pipes); when it exits, everything it
  started dies with it;
- its own `/tmp` (a fresh tmpfs, also `HOME`, `TMPDIR` and the working folder), with the
  read-only paths the agent needs that live under `/tmp` (its code, the Python install)
  bound back in;
- an unprivileged uid where the sandbox can switch to one (the controller runs as root),
  no capabilities, none regained by `exec` (securebits, bounding set, `no_new_privs`).

Linux only; every call goes through libc, as bubblewrap's own do.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from rollover.processes import die_with_parent

SCRATCH = "/tmp"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
# NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE and their locks, KEEP_CAPS locked off:
# uid 0 gains nothing by exec, and nothing can turn that back.
_SECUREBITS = 0b1110_1111
_CAPABILITY_VERSION_3 = 0x20080522

_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


class ConfineError(OSError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise ConfineError(errno, f"{what}: {os.strerror(errno)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    assert _LIBC is not None
    _check(
        _LIBC.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def enter_namespaces() -> None:
    """In the attempt's first process: its next child starts a PID and mount namespace."""
    if _LIBC is None:
        raise ConfineError(0, "the sandbox needs Linux")
    _check(_LIBC.unshare(_CLONE_NEWNS | _CLONE_NEWPID), "unshare")


def set_up_filesystem(kept_under_scratch: list[str], uid: int | None) -> None:
    """PID 1 of the attempt: its own /proc and a fresh scratch /tmp (and /dev/shm), with the
    read-only `kept_under_scratch` paths bound back. Opened before /tmp is covered, each is
    bound again through its file descriptor (the covered mount stays reachable that way)."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    handles = [(path, os.open(path, os.O_PATH)) for path in kept_under_scratch if os.path.exists(path)]
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("tmpfs", SCRATCH, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=0700{owner}")
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=0700{owner}")
    for path, handle in handles:
        if os.path.isdir(f"/proc/self/fd/{handle}"):
            os.makedirs(path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            open(path, "a").close()
        # A bind keeps its source's read-only flag, and the hidden folders mounted inside it.
        _mount(f"/proc/self/fd/{handle}", path, None, _MS_BIND | _MS_REC)
        os.close(handle)
    # The parents made above belong to root; the scratch itself to the agent.
    os.chmod(SCRATCH, 0o700)


def drop_privileges(uid: int | None) -> None:
    """Every capability gone for good; `uid` (when the sandbox runs as real root) the agent's."""
    assert _LIBC is not None
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last_cap = int(handle.read())
    for cap in range(last_cap + 1):
        _check(_LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "drop the bounding set")
    _check(_LIBC.prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0), "securebits")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_LIBC.capset(ctypes.byref(header), data), "capset")
    _check(_LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _exit_on_term(signum: int, _frame: object) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(128 + signum)


def behave_as_init() -> None:
    """PID 1 of a namespace gets no signal it has no handler for: SIGTERM (the controller's
    stop) would be lost, so it ends the agent as the default action would."""
    if os.getpid() == 1:
        signal.signal(signal.SIGTERM, _exit_on_term)


def wait_and_mirror(child: int) -> int:
    """In the attempt's first process, outside its PID namespace: wait for PID 1 there and
    end as it did (its code, or its signal), so the controller sees the agent's own fate."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent gets the group's signal itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def confine_attempt(kept_under_scratch: list[str], uid: int | None) -> int | None:
    """Called in a fresh fork of the fork server. Returns None in the agent's process (PID 1
    of its namespace, confined: run the agent), or the exit code the caller should end with
    (the first process, which waited for the agent)."""
    enter_namespaces()
    pid = os.fork()
    if pid:
        return wait_and_mirror(pid)
    die_with_parent()
    set_up_filesystem(kept_under_scratch, uid)
    drop_privileges(uid)
    behave_as_init()
    os.chdir(SCRATCH)
    return None
