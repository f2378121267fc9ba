"""The process-group leader `VLLMEngine` spawns: it runs vLLM's API server as its child and
cleans up after it.

    python -m rollover.engine.supervisor PARENT_PID GRACE_SECONDS -- COMMAND...

Why not run vLLM directly: a parent-death signal reaches only the server process, and vLLM's
engine-core and worker processes outlive a killed server (measured with vLLM 0.32: they stay
up, holding memory, with no parent). The supervisor is in the same process group as all of
them and sweeps the group when the server exits for any reason, when it is asked to stop
(SIGTERM or SIGHUP), or when the process that started it dies (its own parent-death signal is
SIGTERM). The server gets SIGTERM too if the supervisor itself is killed. It imports only
`rollover.processes`, so it is up in a fraction of a second.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

from rollover.processes import die_with_parent, exit_if_orphaned, group_members

SWEEP_WAIT_SECONDS = 2.0


def supervise(parent_pid: int, grace_s: float, command: list[str]) -> int:
    """Run `command` until it exits or a stop is asked; sweep the group; return its exit code
    in the shell's convention (128 + signal for a signalled server)."""
    exit_if_orphaned(parent_pid, signal.SIGTERM)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGHUP, lambda signum, frame: stop.append(signum))
    server = subprocess.Popen(command, preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
    while server.poll() is None and not stop:
        time.sleep(0.1)
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass

    def others() -> set[int]:
        return group_members(os.getpgrp()) - {os.getpid()}

    deadline = time.monotonic() + SWEEP_WAIT_SECONDS
    while others() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in others():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    code = server.wait()
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m rollover.engine.supervisor PARENT_PID GRACE_SECONDS -- COMMAND...", file=sys.stderr)
        return 2
    return supervise(int(argv[0]), float(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
