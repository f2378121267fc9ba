"""The capacity planner against the real system: predicted vs measured async/sync speed-up.

`rollover.simulate` runs the real trainer loop in virtual time. Here it gets what a
real run measured: the rollout durations from the sync run's store (or a `--durations`
file), the trainer's time per step outside the rollout (update + weight sync, from the sync
run's metrics), the async run's mean drain, and the same batch, n, window, agent capacity and
number of updates. It predicts the async/sync speed-up (averaged over `--sim-seeds` seeds:
the measurement is one run of a few updates) and prints it next to the measured one, with the
relative error, both with the planner's default (rollouts frozen during the update) and with
rollouts progressing during it.

Three ways to get the measurement:
  python benchmarks/simulate_vs_measured.py [async_vs_sync flags]   # run async_vs_sync now
  python benchmarks/simulate_vs_measured.py --from runs/bench/async_vs_sync   # its run folders
  python benchmarks/simulate_vs_measured.py --durations d.jsonl --update-seconds 2 \\
      --measured-speedup 1.4 [--batch 4 --n 4 --window 2 --updates 6]        # figures by hand
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import async_vs_sync  # noqa: E402
from benchmarks.async_vs_sync import ModeResult  # noqa: E402
from rollover.config import load_config  # noqa: E402
from rollover.simulate import Empirical, Scenario, load_durations, simulate, window_sizes  # noqa: E402

# What the planner is told about the real system ("inputs") is a `Scenario`: the measured
# durations (`Empirical`), batch, n, capacity, as many updates as were measured, the trainer's
# time per step outside the rollout minus the weight sync (`update_seconds`) and the weight
# sync (`sync_seconds`). Drain, seed and freezing are set per simulated run.


def measured_durations(inputs: Scenario) -> tuple[float, ...]:
    assert isinstance(inputs.distribution, Empirical)
    return inputs.distribution.durations


def inputs_json(inputs: Scenario) -> dict[str, Any]:
    return {
        "durations": list(measured_durations(inputs)),
        "batch": inputs.batch_size,
        "n": inputs.n,
        "capacity": inputs.agents,
        "updates": inputs.steps,
        "update_s": inputs.update_seconds,
        "sync_s": inputs.sync_seconds,
    }


@dataclass(frozen=True)
class Measured:
    window: int
    speedup: float  # sync training time / async training time, same number of updates
    drain_s: float  # the async run's mean proxy_drain_seconds
    own_inputs: Scenario | None = None  # the async run's own durations and update time, when known


@dataclass
class Comparison:
    window: int
    multiplier: float
    measured: float
    predicted: float  # rollouts frozen during update and sync (the planner's default)
    predicted_running: float  # rollouts progressing during update and sync
    drain_s: float
    # Sync simulated from the sync run's inputs, async from the async run's own durations and
    # update time (not frozen again): what is left of the error once the planner knows how
    # the inputs drift between modes (slower updates and agent starts under CPU contention).
    predicted_own_inputs: float | None = None

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def error_running(self) -> float:
        return (self.predicted_running - self.measured) / self.measured

    @property
    def error_own_inputs(self) -> float | None:
        if self.predicted_own_inputs is None:
            return None
        return (self.predicted_own_inputs - self.measured) / self.measured

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {
            "relative_error": self.error,
            "relative_error_running": self.error_running,
            "relative_error_own_inputs": self.error_own_inputs,
        }


def simulated_seconds(inputs: Scenario, window: int | None, drain_s: float, seeds: int, freeze: bool = True) -> float:
    """Mean simulated time of `inputs.steps` updates with `window` (None: sync) over `seeds` seeds."""
    total = 0.0
    for seed in range(seeds):
        scenario = replace(inputs, drain_seconds=drain_s, seed=seed, pause_freezes_rollouts=freeze)
        total += simulate(scenario, window).wall_seconds
    return total / seeds


def predict(inputs: Scenario, window: int, drain_s: float, seeds: int, freeze: bool = True) -> float:
    """Expected speed-up of `window` over sync (mean times over `seeds` simulated runs)."""
    return simulated_seconds(inputs, None, 0.0, seeds, freeze) / simulated_seconds(
        inputs, window, drain_s, seeds, freeze
    )


def compare(inputs: Scenario, measured: Sequence[Measured], seeds: int = 20) -> list[Comparison]:
    sync_s = simulated_seconds(inputs, None, 0.0, seeds)
    return [
        Comparison(
            window=m.window,
            multiplier=m.window / inputs.batch_size,
            measured=m.speedup,
            predicted=predict(inputs, m.window, m.drain_s, seeds, freeze=True),
            predicted_running=predict(inputs, m.window, m.drain_s, seeds, freeze=False),
            drain_s=m.drain_s,
            predicted_own_inputs=(
                # The async run's durations already hold the time its rollouts stood still in
                # pauses: freezing them again would count it twice.
                sync_s / simulated_seconds(m.own_inputs, m.window, m.drain_s, seeds, freeze=False)
                if m.own_inputs
                else None
            ),
        )
        for m in measured
    ]


def from_results(
    sync: ModeResult, asyncs: Sequence[ModeResult], capacity: int, durations: Empirical | None = None
) -> tuple[Scenario, list[Measured]]:
    """Planner inputs and measurements from an async_vs_sync run's results."""

    def inputs_of(run: ModeResult, given: Empirical | None) -> Scenario:
        return Scenario(
            given or load_durations(run.run_dir),
            batch_size=sync.window,
            n=_run_config(sync.run_dir).actor_rollout_ref.rollout.n,
            capacity=capacity,
            steps=sync.updates,
            update_seconds=max(run.busy_s_mean - run.weight_sync_s_mean, 0.0),
            sync_seconds=run.weight_sync_s_mean,
        )

    measured = [
        Measured(window=r.window, speedup=r.speedup_over(sync), drain_s=r.drain_s_mean, own_inputs=inputs_of(r, None))
        for r in asyncs
    ]
    return inputs_of(sync, durations), measured


def _run_config(run_dir: str | Path) -> Any:
    return load_config(Path(run_dir) / "config.yaml")


def read_runs(out_dir: Path) -> tuple[ModeResult, list[ModeResult], int]:
    """The sync and async-w* run folders an async_vs_sync run left in `out_dir`."""
    sync_dir = out_dir / "sync"
    if not (sync_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"{sync_dir} holds no metrics.jsonl: run benchmarks/async_vs_sync.py --out {out_dir} first")
    config = _run_config(sync_dir)
    sync = async_vs_sync.summarise_run("sync", config.data.train_batch_size, sync_dir, 0.0)
    asyncs = []
    for run_dir in sorted(out_dir.glob("async-w*"), key=lambda p: int(p.name.removeprefix("async-w"))):
        window = _run_config(run_dir).agentlightning.async_rollout.async_train_batch_size
        asyncs.append(async_vs_sync.summarise_run("async", window, run_dir, 0.0))
    if not asyncs:
        raise SystemExit(f"{out_dir} holds no async-w* run folder")
    return sync, asyncs, config.agentlightning.local.max_concurrency


def format_comparisons(inputs: Scenario, comparisons: Sequence[Comparison], load: Sequence[float] | None = None) -> str:
    durations = measured_durations(inputs)
    lines = [
        f"planner inputs: {len(durations)} measured durations (mean {statistics.fmean(durations):.2f}s, max {max(durations):.2f}s); "
        f"batch {inputs.batch_size} x n {inputs.n}; capacity {inputs.agents}; {inputs.steps} updates; "
        f"update {inputs.update_seconds:.2f}s + weight sync {inputs.sync_seconds:.2f}s per step",
    ]
    if load is not None:
        lines.append(f"load average {'/'.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} CPUs")
    header = (
        f"{'window':>7}{'mult':>6}{'drain s':>8}{'measured':>10}{'predicted':>11}{'error':>8}{'pred. running':>15}{'error':>8}"
        f"{'pred. own inputs':>18}{'error':>8}"
    )
    lines += [header, "-" * len(header)]
    for c in comparisons:
        lines.append(
            f"{c.window:>7}{c.multiplier:>5g}x{c.drain_s:>8.2f}{c.measured:>9.2f}x{c.predicted:>10.2f}x{c.error:>+8.0%}"
            f"{c.predicted_running:>14.2f}x{c.error_running:>+8.0%}"
            + (
                f"{c.predicted_own_inputs:>17.2f}x{c.error_own_inputs:>+8.0%}"
                if c.predicted_own_inputs is not None
                else ""
            )
        )
    lines.append(
        "predicted: from the sync run's durations and update time, rollouts frozen during update + sync (planner default)"
    )
    lines.append("pred. running: the same, rollouts progressing meanwhile")
    if any(c.predicted_own_inputs is not None for c in comparisons):
        lines.append(
            "pred. own inputs: sync from the sync run's inputs; async from the async run's own durations (pauses included) and update time"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], parents=[async_vs_sync.parser(add_help=False)]
    )
    parser.add_argument(
        "--from",
        dest="from_dir",
        type=Path,
        default=None,
        help="compare the run folders an async_vs_sync run left here",
    )
    parser.add_argument(
        "--durations", type=Path, default=None, help='durations: JSONL of {"duration_s": x}, a store or a run folder'
    )
    parser.add_argument(
        "--update-seconds", type=float, default=None, help="with --measured-speedup: update time per step"
    )
    parser.add_argument(
        "--sync-seconds", type=float, default=0.0, help="with --measured-speedup: weight sync per step (default 0)"
    )
    parser.add_argument(
        "--drain-seconds", type=float, default=0.0, help="with --measured-speedup: drain per step (default 0)"
    )
    parser.add_argument(
        "--measured-speedup", type=float, default=None, help="a measured async/sync speed-up to compare with"
    )
    parser.add_argument("--sim-seeds", type=int, default=20, help="simulated runs per prediction (default 20)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    given = load_durations(args.durations) if args.durations else None
    load: Sequence[float] | None = None
    measurement: dict[str, Any] | None = None
    if args.measured_speedup is not None:
        if given is None or args.update_seconds is None:
            raise SystemExit("--measured-speedup needs --durations and --update-seconds")
        [window] = window_sizes(args.batch, [args.window])
        inputs = Scenario(
            given,
            batch_size=args.batch,
            n=args.n,
            capacity=args.capacity or args.batch * args.n,
            steps=args.updates,
            update_seconds=args.update_seconds,
            sync_seconds=args.sync_seconds,
        )
        measured = [Measured(window, args.measured_speedup, args.drain_seconds)]
    elif args.from_dir is not None:
        sync, asyncs, capacity = read_runs(args.from_dir.resolve())
        inputs, measured = from_results(sync, asyncs, capacity, given)
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import logging

        logging.basicConfig(level=logging.WARNING)
        settings = async_vs_sync.settings_from(args)
        report = async_vs_sync.run_benchmark(settings, async_vs_sync.SWEEP_WINDOWS if args.sweep else (args.window,))
        measurement = report.to_json()
        if not args.json:
            print(async_vs_sync.format_report(report), end="\n\n")
        inputs, measured = from_results(report.sync, report.asyncs, settings.agents, given)
        load = report.load_after
    comparisons = compare(inputs, measured, args.sim_seeds)
    if args.json:
        print(
            json.dumps(
                {
                    "inputs": inputs_json(inputs),
                    "comparisons": [c.to_json() for c in comparisons],
                    "loadavg": list(load or os.getloadavg()),
                    "measurement": measurement,
                }
            )
        )
    else:
        print(format_comparisons(inputs, comparisons, load or os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
