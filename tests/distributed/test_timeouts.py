"""trainer.nccl_timeout bounds the training collectives; waiting for rank 0's next command
(through its rollouts) has a group of its own with the long COMMAND_TIMEOUT.

Two real ranks started by torch's launcher (gloo on CPU), see timeout_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollover.distributed.world import COMMAND_TIMEOUT

WORKER = Path(__file__).with_name("timeout_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def launch(nccl_timeout: float, action: str, tmp_path: Path) -> dict[str, object]:
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [*command, str(WORKER), str(nccl_timeout), action, str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(report.read_text())


def test_the_default_group_takes_nccl_timeout_and_the_command_channel_its_own(tmp_path):
    report = launch(37, "read", tmp_path)
    assert report == {"default_group_s": 37.0, "channel_group_s": COMMAND_TIMEOUT.total_seconds()}


@pytest.mark.slow  # waits out a timeout of seconds
def test_a_command_outwaits_nccl_timeout_while_a_training_collective_does_not(tmp_path):
    timeout_s = 2.0
    report = launch(timeout_s, "wait", tmp_path)
    # The command came 2.5 x nccl_timeout late and was still received...
    assert report["command"] == "Stop(reason='late')"
    assert isinstance(report["command_waited_s"], float) and report["command_waited_s"] > timeout_s
    # ...while a collective on the training group gave up after nccl_timeout (with a long
    # timeout rank 1 would wait on rank 0, who waits on rank 1's report: the launch times out).
    error = report["collective_error"]
    assert isinstance(error, str) and "timed out" in error.lower(), error
