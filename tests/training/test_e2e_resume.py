"""kill -9 of `rollover train` mid-run, then `resume=true` finishes the same run."""

import json
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollover.metrics import read_jsonl

pytestmark = pytest.mark.vllm

CALC_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "calc" / "config.yaml"


def processes_carrying(marker: str) -> set[int]:
    """Live processes whose environment holds the marker: the trainer's whole family (gateway,
    vLLM and its workers, agents) inherits it, and nothing else on the machine has it."""
    needle = f"ROLLOVER_TEST_RUN={marker}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    if b"Z" not in (entry / "stat").read_bytes().rsplit(b")", 1)[1][:3]:
                        found.add(int(entry.name))
            except OSError:
                continue
    return found


def train_command(tmp_path, calc_model, *extra):
    return [
        sys.executable,
        "-m",
        "rollover.cli.main",
        "train",
        str(CALC_CONFIG),
        f"trainer.default_local_dir={tmp_path}",
        "trainer.experiment_name=resumable",
        f"actor_rollout_ref.model.path={calc_model}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "data.val_files=null",  # no held-out evaluation: what is checked is the resume
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=8",
        *extra,
    ]


def test_kill_9_then_resume_completes_the_run(tmp_path, calc_model, monkeypatch):
    monkeypatch.setenv("ROLLOVER_CALC_LATENCY_MEDIAN", "0.3")
    marker = uuid.uuid4().hex
    monkeypatch.setenv("ROLLOVER_TEST_RUN", marker)
    run_dir = tmp_path / "resumable"
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(train_command(tmp_path, calc_model), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        latest = run_dir / "checkpoints" / "latest"
        if latest.exists() and int(latest.read_text().removeprefix("step_")) >= 1:
            break
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.5)
    else:
        pytest.fail("no checkpoint at step 1 in time: " + (tmp_path / "first.log").read_text()[-3000:])
    time.sleep(1.0)  # let step 2 get under way: rollouts in flight when the trainer dies
    first.send_signal(signal.SIGKILL)
    first.wait()
    # Parent-death signals take the gateway, vLLM and the agents down with the trainer.
    deadline = time.monotonic() + 30
    while processes_carrying(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_carrying(marker) == set()

    second = subprocess.run(
        train_command(tmp_path, calc_model, "resume=true"), capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed step_" in second.stderr
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "training/async/n_completed_rollouts" in r]
    assert steps[-1] == 3 and set(range(1, 4)) <= set(steps)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_3"
    with sqlite3.connect(run_dir / "store.db") as db:
        unfinished = db.execute("SELECT COUNT(*) FROM rollouts WHERE state IN ('queuing', 'running')").fetchone()[0]
        aborted = db.execute(
            "SELECT COUNT(*) FROM rollouts WHERE error_message LIKE 'aborted: trainer restarted%'"
        ).fetchone()[0]
    assert unfinished == 0
    assert aborted > 0  # the dead run's rollouts were reconciled, not left running
    state = json.loads((run_dir / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["policy_version"] == 3
