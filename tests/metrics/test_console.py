"""The live console in its plain-line mode: what a log file of a run shows."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from rollover.metrics.console import LiveConsole, RunSummary, format_duration
from rollover.metrics.progress import WindowStatus
from rollover.simulate import LogNormal, Scenario, Simulation


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=300, force_terminal=False, color_system=None), out


def window(done: int, running: int = 3, queued: int = 1, carry: int = 0, age: int = 0) -> WindowStatus:
    return WindowStatus(
        completed_groups=done,
        target_groups=4,
        running=running,
        queued=queued,
        carry_over=carry,
        oldest_carry_over_age=age,
    )


def test_not_a_terminal_means_plain_lines():
    console, _ = plain_console()
    assert LiveConsole(console).live_mode is False


def test_plain_lines_name_the_phase_and_its_counts_and_are_throttled():
    console, out = plain_console()
    clock = FakeClock()
    progress = LiveConsole(console, min_interval_s=5, heartbeat_s=30, clock=clock)
    progress.step_started(3, 20)
    progress.rollout_wait(window(0, carry=8, age=2))
    clock.now = 1
    progress.rollout_wait(window(1))  # moved, but within min_interval_s of the last line
    clock.now = 2
    progress.rollout_wait(window(1, running=2))  # same count: nothing
    clock.now = 7
    progress.rollout_wait(window(2, running=1, queued=0))  # moved, 7 s after the last line
    clock.now = 8
    progress.drain(3)
    clock.now = 9
    progress.update(0, 0)
    progress.update(1, 4)
    clock.now = 40
    progress.update(1, 4)  # unchanged, but a heartbeat is due
    progress.weight_sync()
    progress.step_finished(3, {})
    progress.step_started(4, 20)
    progress.rollout_wait(window(0))
    progress.evaluation(5, 128)

    lines = out.getvalue().splitlines()
    assert lines == [
        "[step 3/20] rollout wait: groups 0/4, running 3, queued 1, carry-over 8 (oldest 2 steps) (0.0s)",
        "[step 3/20] rollout wait: groups 2/4, running 1, queued 0, carry-over 0 (7.0s)",
        "[step 3/20] drain: 3 calls in flight (0.0s)",
        "[step 3/20] update: recomputing logprobs (0.0s)",
        "[step 3/20] update: optimizer step 1/4 (31.0s)",
        "[step 3/20] weight sync (0.0s)",
        "[step 4/20] rollout wait: groups 0/4, running 3, queued 1, carry-over 0 (0.0s)",
        "[step 4/20] evaluation: 5/128 held-out tasks (0.0s)",
    ]


def test_a_simulated_run_reports_every_phase_of_every_step():
    """The real trainer (in `rollover simulate`'s virtual world) drives the console."""
    sim = Simulation(Scenario(LogNormal(median=1.0, sigma=1.0), batch_size=2, n=2, steps=3), window=4)
    console, out = plain_console()
    sim.trainer.progress = LiveConsole(console, clock=sim.backend.now)
    sim.run()
    text = out.getvalue()
    for step in (1, 2, 3):
        for phase in ("rollout wait: groups 0/2", "drain:", "update", "weight sync"):
            assert f"[step {step}/3] {phase}" in text, (step, phase, text)
    # By the second step the window holds groups carried over from the first.
    carried = re.findall(r"\[step [23]/3\] rollout wait: .*carry-over (\d+) \(oldest (\d+) steps?\)", text)
    assert carried and all(int(n) > 0 and int(age) >= 1 for n, age in carried), text


def test_summary_lines():
    history = [
        {"step": 0, "val/reward_mean": 0.367},
        {"step": 1, "critic/score/mean": 0.5},
        {"step": 2, "critic/score/mean": 0.75},
        {"step": 2, "val/reward_mean": 0.992},
    ]
    summary = RunSummary.from_history(history, steps=2, wall_s=312.0, run_dir=Path("runs/calc"))
    console, out = plain_console()
    LiveConsole(console).summary(summary)
    assert out.getvalue().splitlines() == [
        "run finished: 2 steps in 5m12s",
        "held-out reward: 0.367 -> 0.992",
        "last training reward: 0.750",
        "run folder: runs/calc  (see it: rollover view runs/calc)",
    ]


def test_durations():
    assert [format_duration(s) for s in (0.04, 59.9, 61, 3725)] == ["0.0s", "59.9s", "1m01s", "1h02m"]
