"""The sandbox local agents run in (`agentlightning.local.sandbox`, on by default): what they
see of the machine, built with bubblewrap (`bwrap`, Debian's `bubblewrap`) around the fork
server, which then confines each attempt it forks (`confine.py`).

What an agent sees:

- the filesystem read-only, with `/tmp`, `/var/tmp`, `/run`, `$HOME` and the run's own paths
  (run folder, store, weights, checkpoints, agent logs) covered by empty folders; its code
  (the controller's working folder) and the Python install are bound back read-only;
- a private writable `/tmp` of its own (its home and working folder);
- a network namespace with loopback only, where 127.0.0.1:<gateway port> is a bridge to the
  gateway (`bridge.py`): engines, the TCPStore, the viewer and everything else on the host's
  loopback do not exist there;
- no other process: each attempt is PID 1 of its own PID namespace.

As root (CI) bubblewrap runs privileged and each agent drops to `nobody`; as a normal user it
makes a user namespace and the agent keeps the user's uid with no capability. A kernel that
refuses the namespaces stops the controller with one line: the agents then run only if the
config says `sandbox: false`.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rollover.controller.confine import SCRATCH

# Where the gateway bridge's Unix socket appears inside the sandbox.
SOCKET_DIR = "/run/rollover"
SOCKET_NAME = "gateway.sock"
# The agent's uid when the controller runs as root: `nobody` owns nothing on the machine.
NOBODY = 65534
# Covered by empty folders: where a machine keeps per-user state, sockets and temp files.
COVERED = ("/tmp", "/var/tmp", "/run", "/dev/shm")


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing, or the kernel refuses its namespaces."""


def _contains(parent: str, child: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def python_paths() -> list[str]:
    """What an agent's Python needs to see: the interpreter, its install and every import path."""
    candidates = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
        *sys.path,
        *os.environ.get("PYTHONPATH", "").split(os.pathsep),
    ]
    return [p for p in candidates if p and os.path.exists(p)]


def minimal(paths: list[str]) -> list[str]:
    """`paths` made absolute, without duplicates or paths inside another one of them."""
    kept: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths}, key=len):
        if not any(_contains(k, path) for k in kept):
            kept.append(path)
    return kept


@dataclass(frozen=True)
class SandboxLayout:
    """The paths an agent sees (`kept`, read-only) and may not see (`hidden`)."""

    kept: tuple[str, ...]
    hidden: tuple[str, ...]
    covered: tuple[str, ...]
    socket_dir: str  # the host folder holding the gateway bridge's socket

    @classmethod
    def build(cls, cwd: Path, hidden: list[Path], socket_dir: Path) -> SandboxLayout:
        home = os.environ.get("HOME", "")
        covered = [c for c in COVERED if os.path.isdir(c)]
        if home and os.path.isdir(home) and os.path.realpath(home) != "/":
            covered.append(os.path.realpath(home))
        kept = minimal([str(cwd), *python_paths()])
        hidden_paths = minimal([str(p) for p in hidden])
        return cls(tuple(kept), tuple(hidden_paths), tuple(covered), str(socket_dir))

    def kept_under_scratch(self) -> list[str]:
        """The kept paths an attempt's own /tmp would cover: it binds them back."""
        return [k for k in self.kept if _contains(SCRATCH, k)]

    def bwrap_args(self) -> list[str]:
        """bubblewrap's options, in mount order: later mounts cover earlier ones."""
        args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for path in self.covered:
            args += ["--tmpfs", path]
        made: set[str] = set()
        for path in self.kept:
            root = next((c for c in self.covered if _contains(c, path)), None)
            if root is None:
                continue
            # bubblewrap would make the folders above it 0700: the agent could not pass them.
            parent = os.path.dirname(path)
            ancestors = []
            while parent != root and _contains(root, parent):
                ancestors.append(parent)
                parent = os.path.dirname(parent)
            for folder in reversed(ancestors):
                if folder not in made:
                    made.add(folder)
                    args += ["--perms", "0755", "--dir", folder]
            args += ["--ro-bind", path, path]
        for path in self.hidden:
            if os.path.isdir(path):
                args += ["--tmpfs", path]
            else:
                for name in (path, f"{path}-wal", f"{path}-shm", f"{path}-journal"):
                    if os.path.exists(name):
                        args += ["--ro-bind", "/dev/null", name]
        args += ["--bind", self.socket_dir, SOCKET_DIR, "--chdir", "/"]
        return args


def bwrap_command(layout: SandboxLayout, command: list[str], env: dict[str, str]) -> list[str]:
    """`command` inside the sandbox: new user (unless root), PID, network, IPC and UTS
    namespaces, dying with the controller. The fork server keeps the capabilities of its
    namespace (to set up each attempt's); its agents give them up."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: install it (Debian: apt-get install bubblewrap)")
    user = [] if os.geteuid() == 0 else ["--unshare-user", "--uid", "0", "--gid", "0"]
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    setenv = [arg for name, value in env.items() for arg in ("--setenv", name, value)]
    return [
        bwrap,
        *user,
        *namespaces,
        "--die-with-parent",
        "--cap-add",
        "ALL",
        *layout.bwrap_args(),
        "--clearenv",
        *setenv,
        "--",
        *command,
    ]


def agent_uid() -> int | None:
    """The uid agents drop to: `nobody` when the sandbox runs as real root, else their own."""
    return NOBODY if os.geteuid() == 0 else None
