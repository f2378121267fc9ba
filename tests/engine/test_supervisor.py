"""The supervisor vLLM runs under: it passes the server's exit code on, and whatever way the
server ends, nothing of its process group is left (vLLM's engine core and workers would
otherwise outlive it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollover.processes import group_members, pid_alive

# A "server" that leaves a child behind in its process group, as vLLM's engine core does,
# writes that child's pid, then exits with code 3 unless told to wait.
SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(600)
"""


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int]:
    pid_file = tmp_path / "child.pid"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "rollover.engine.supervisor", str(os.getpid()), "5", "--"]
        + [sys.executable, "-c", SERVER, str(pid_file), mode],
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return supervisor, int(pid_file.read_text())


def gone(pgid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not group_members(pgid)


def test_the_server_exit_code_is_passed_on_and_its_leftovers_are_swept(tmp_path):
    supervisor, child = start(tmp_path, "exit")
    assert supervisor.wait(timeout=60) == 3
    assert gone(supervisor.pid) and not pid_alive(child)


@pytest.mark.slow
def test_sigterm_stops_the_server_and_sweeps_the_group(tmp_path):
    supervisor, child = start(tmp_path, "wait")
    assert pid_alive(child)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == 128 + signal.SIGTERM  # the server was terminated
    assert gone(supervisor.pid) and not pid_alive(child)


def test_refuses_a_bad_command_line():
    out = subprocess.run([sys.executable, "-m", "rollover.engine.supervisor", "1"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage:" in out.stderr


@pytest.mark.slow
def test_the_death_of_the_process_that_started_it_stops_everything(tmp_path):
    """A trainer killed with SIGKILL leaves no vLLM behind."""
    pid_file, info = tmp_path / "child.pid", tmp_path / "supervisor.pid"
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-m', 'rollover.engine.supervisor', str(os.getpid()), '5', '--',"
            " sys.executable, '-c', sys.argv[1], sys.argv[2], 'wait'], start_new_session=True)\n"
            "open(sys.argv[3], 'w').write(str(p.pid))\n"
            "time.sleep(600)\n",
            SERVER,
            str(pid_file),
            str(info),
        ]
    )
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text() and info.exists() and info.read_text()):
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    supervisor, child = int(info.read_text()), int(pid_file.read_text())
    starter.kill()
    starter.wait()
    assert gone(supervisor) and not pid_alive(child)
