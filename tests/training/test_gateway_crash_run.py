"""A SIGKILLed gateway in the middle of a real run: `rollover train` restarts it on the same
port and store, paused or not as it was, with its engine registered; agents, controller and
trainer ride the gap out, and the run finishes with every step logged."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rollover.config import load_config
from rollover.gateway.server import GatewayDied
from rollover.launch import run_training
from rollover.processes import descendant_pids
from tests.runs import train_briefly

pytestmark = pytest.mark.vllm

CALC_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "calc" / "config.yaml"


def _gateway_pids() -> list[int]:
    found = []
    for pid in descendant_pids(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rollover.cli.main" in argv and b"gateway" in argv:
            found.append(pid)
    return found


class GatewayKiller:
    """SIGKILLs the run's gateway process once the first training step is logged (the next
    step's rollouts are being queued and claimed then)."""

    def __init__(self, metrics: Path) -> None:
        self.metrics = metrics
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.metrics.is_file() and '"training/' in self.metrics.read_text():
                pids = _gateway_pids()
                if pids:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)
                    return
            time.sleep(0.2)

    def __enter__(self) -> GatewayKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_run_rides_out_a_sigkilled_gateway(tmp_path, calc_model, vllm_engine):
    steps = 2
    with GatewayKiller(tmp_path / "crash" / "metrics.jsonl") as killer:
        train, _ = train_briefly(
            CALC_CONFIG,
            tmp_path,
            calc_model,
            "crash",
            steps,
            "data.val_batch_size=8",
            "algorithm.filter_groups.enable=false",  # plumbing: no top-up groups
            engine=vllm_engine,
        )
    assert killer.killed, "the gateway was never killed"
    assert [row["step"] for row in train] == list(range(1, steps + 1))
    # Started twice on one port: once by the run, once by its watchdog after the SIGKILL.
    starts = [line for line in (tmp_path / "crash" / "gateway.log").read_text().splitlines() if "gateway http" in line]
    assert len(starts) == 2 and starts[0] == starts[1], starts


def test_a_run_whose_gateway_cannot_come_back_stops_naming_it(tmp_path, calc_model, vllm_engine):
    config = load_config(
        CALC_CONFIG,
        [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.experiment_name=dead",
            f"actor_rollout_ref.model.path={calc_model}",
            "trainer.total_training_steps=3",
            "data.val_batch_size=8",
            "gateway.max_restarts=0",
            "algorithm.filter_groups.enable=false",
        ],
    )
    with GatewayKiller(tmp_path / "dead" / "metrics.jsonl") as killer:
        with pytest.raises(GatewayDied, match=r"gateway.max_restarts=0\): gateway process \d+ was killed by signal 9"):
            run_training(config, engine=vllm_engine)
    assert killer.killed
