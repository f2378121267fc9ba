"""`rollover simulate`: the real Trainer in virtual time, its numbers, and its command line."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from rollover.cli.main import main as rollover_main
from rollover.simulate import (
    Constant,
    Empirical,
    LogNormal,
    Scenario,
    Simulation,
    ideal_step_seconds,
    load_durations,
    recommend,
    simulate,
    window_sizes,
)
from rollover.simulate.cli import main
from rollover.store.file import SCHEMA as _SCHEMA
from rollover.store.models import RolloutState
from rollover.training.manager import AsyncRolloutManager
from tests.runs import SEED_ASYNC_METRICS, SEED_TIMING_METRICS

LOGNORMAL = Scenario(LogNormal(median=1.0, sigma=1.0), batch_size=4, n=4, steps=60, update_seconds=1.0)


def test_constant_durations_gain_nothing_and_sync_idles_for_the_duration() -> None:
    scenario = Scenario(Constant(2.0), batch_size=4, n=2, steps=10, update_seconds=1.0)
    sync = simulate(scenario)
    windowed = simulate(scenario, window=8)
    assert not sync.async_enabled and windowed.async_enabled and windowed.window == 8
    assert sync.updates_per_hour == pytest.approx(3600 / 3.0)  # 2 s rollout + 1 s update
    assert windowed.updates_per_hour == pytest.approx(sync.updates_per_hour)
    assert sync.idle_seconds_per_step == pytest.approx(2.0)
    assert sync.idle_fraction == pytest.approx(2.0 / 3.0)
    assert sync.max_carry_over_age == 0 and sync.mean_version_lag == 0


def test_lognormal_window_beats_sync_and_carries_groups_over() -> None:
    sync = simulate(LOGNORMAL)
    windowed = simulate(LOGNORMAL, window=8)
    assert windowed.updates_per_hour > 1.3 * sync.updates_per_hour
    assert windowed.idle_fraction < sync.idle_fraction
    assert windowed.mean_carry_over_age > 0 and windowed.max_carry_over_age >= 1
    assert 0 < windowed.mean_version_lag <= windowed.mean_carry_over_age
    assert sync.mean_carry_over_age == 0
    # Seeded: the same scenario gives the same numbers.
    assert simulate(LOGNORMAL, window=8).wall_seconds == windowed.wall_seconds


def test_runs_through_the_trainer_and_never_consumes_an_incomplete_group(monkeypatch: pytest.MonkeyPatch) -> None:
    original = AsyncRolloutManager.enqueue_and_wait_until_group_completed
    results = []

    async def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = await original(self, *args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(AsyncRolloutManager, "enqueue_and_wait_until_group_completed", spy)
    simulation = Simulation(replace(LOGNORMAL, steps=30), window=12)
    outcome = simulation.run()

    assert len(results) == 30
    for result in results:
        assert len(result.completed_groups) == 4
        for group in result.completed_groups:
            assert all(simulation.backend.rollouts[r.rollout_id].state.terminal for r in group)
    assert any(any(r.state.terminal for r in result.new_carry_over_rollouts) for result in results)

    consumed = simulation.gateway.consumed
    assert len(consumed) == 30 * 4 * 4
    assert all(c.state == RolloutState.SUCCEEDED for c in consumed)
    assert set(Counter(c.data_id for c in consumed).values()) == {4}  # whole groups, each once

    step = outcome.history[-1]
    for name in (*SEED_ASYNC_METRICS, *SEED_TIMING_METRICS):
        assert name in step
    assert step["training/async/n_completed_rollouts"] == 16


def test_rollouts_progress_during_updates_when_the_pause_does_not_freeze_them() -> None:
    scenario = Scenario(Constant(2.0), batch_size=4, n=2, steps=10, update_seconds=1.0, pause_freezes_rollouts=False)
    # The next groups overlap the update, so even without variance the window wins.
    assert simulate(scenario, window=8).updates_per_hour > 1.3 * simulate(scenario).updates_per_hour


def test_drain_time_and_the_trainers_staleness_cap_are_simulated() -> None:
    drained = simulate(replace(LOGNORMAL, steps=10, drain_seconds=0.5), window=8)
    drains = [m["training/async/proxy_drain_seconds"] for m in drained.history]
    assert max(drains) == pytest.approx(0.5)
    assert all(
        m["training/async/proxy_inflight_at_pause"] > 0
        for m in drained.history
        if m["training/async/proxy_drain_seconds"]
    )

    capped = simulate(
        replace(LOGNORMAL, overrides=("agentlightning.async_rollout.max_carry_over_age_steps=1",)), window=16
    )
    assert capped.n_aborted_stale_rollouts > 0


def test_ideal_speedup() -> None:
    assert ideal_step_seconds(Constant(3.0), batch_groups=4, n=4, update_seconds=1.0).speedup == pytest.approx(1.0)
    # 4 rollouts on 3 agents: sync takes 2 rounds, the ideal pipeline 4/3 of one.
    assert ideal_step_seconds(Constant(1.0), 2, 2, 1.0, capacity=3).speedup == pytest.approx(3.0 / (4 / 3 + 1.0))
    assert ideal_step_seconds(LogNormal(1.0, 1.0), 4, 4, 1.0, trials=500).speedup > 2.0
    assert ideal_step_seconds([1.0, 1.0], 2, 2, 0.0, trials=10).speedup == pytest.approx(1.0)


def test_windows_and_recommendation() -> None:
    assert window_sizes(4, [1.25, 1.5, 2, 3, 4]) == [5, 6, 8, 12, 16]
    assert window_sizes(1, [1.25, 1.5, 2]) == [2]
    with pytest.raises(ValueError, match="> 1"):
        window_sizes(4, [1.0])
    sync, small, big = simulate(LOGNORMAL), simulate(LOGNORMAL, 6), simulate(LOGNORMAL, 16)
    assert recommend([sync, small, big], max_staleness=100).window == 16
    assert recommend([sync, small, big], max_staleness=100, tolerance=0.99).window == 4
    assert recommend([sync, small, big], max_staleness=0).async_enabled is False


def test_cli_prints_the_table_the_ideal_speedup_and_a_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--batch-size", "4", "--n", "4", "--steps", "20", "--windows", "1.5,2"]) == 0
    out = capsys.readouterr().out
    assert "lognormal(median=1s, sigma=1)" in out
    for label in ("sync", "async 1.5x", "async 2x", "updates/h", "rollouts/s", "idle", "age max", "lag mean"):
        assert label in out
    assert "ideal async speed-up:" in out
    assert "recommended:" in out


def test_cli_json_and_the_rollover_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--batch-size",
        "2",
        "--n",
        "2",
        "--steps",
        "5",
        "--windows",
        "2",
        "--distribution",
        "exponential",
        "--json",
    ]
    assert rollover_main(["simulate", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in report["results"]] == ["sync", "async"]
    assert {"updates_per_hour", "idle_fraction", "max_carry_over_age", "mean_version_lag"} <= set(report["results"][1])
    assert report["ideal_speedup"] > 1.0
    assert "history" not in report["results"][0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "--batch-size: must be >= 1"),
        (["--windows", "0.5,2"], "window multipliers must be > 1"),
        (["--windows", "two"], "comma-separated numbers"),
        (["--distribution", "pareto", "--alpha", "0.9"], "pareto alpha must be > 1"),
        (["--distribution", "exponential", "--sigma", "2"], "--sigma applies to --distribution lognormal"),
        (["--distribution", "empirical"], "needs --durations"),
        (["--durations", "/nonexistent/durations.jsonl"], "durations file not found"),
        (["--update-seconds", "-1"], "--update-seconds: must be a finite number >= 0"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_durations_from_a_jsonl_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "durations.jsonl"
    path.write_text('{"duration_s": 2.0}\n\n{"duration_s": 3}\n{"duration_s": 10.5}\n')
    assert load_durations(path) == Empirical((2.0, 3.0, 10.5), source=str(path))
    assert main(["--durations", str(path), "--batch-size", "2", "--n", "2", "--steps", "5", "--windows", "2"]) == 0
    assert "empirical(3 durations" in capsys.readouterr().out

    path.write_text('{"duration_s": 2.0}\n{"seconds": 1}\n')
    with pytest.raises(ValueError, match=r"durations.jsonl:2: expected"):
        load_durations(path)


def test_durations_from_a_run_folder_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [  # (id, state, started_at, finished_at)
        ("a", "succeeded", 100.0, 102.0),
        ("b", "succeeded", 100.0, 103.0),
        ("c", "succeeded", 101.0, 106.0),
        ("d", "failed", 100.0, 100.5),  # aborted: not a duration
        ("e", "queuing", None, None),
        ("f", "running", 104.0, None),
    ]
    with sqlite3.connect(run_dir / "store.db") as conn:
        conn.executescript(_SCHEMA)
        conn.executemany(
            "INSERT INTO rollouts (rollout_id, input, is_train, config, metadata, state, created_at, updated_at,"
            " started_at, finished_at) VALUES (?, '{}', 1, '{}', '{}', ?, 99.0, 99.0, ?, ?)",
            rows,
        )
    conn.close()
    loaded = load_durations(run_dir)
    assert sorted(loaded.durations) == [2.0, 3.0, 5.0]
    assert sorted(load_durations(run_dir / "store.db").durations) == [2.0, 3.0, 5.0]
    assert main(["--durations", str(run_dir), "--batch-size", "2", "--n", "2", "--steps", "5", "--windows", "2"]) == 0
    assert "empirical(3 durations" in capsys.readouterr().out

    with pytest.raises(ValueError, match="without store.db"):
        load_durations(tmp_path)
