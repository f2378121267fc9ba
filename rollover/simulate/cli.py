"""`rollover simulate [...]`: the planner's command line (a table, or one JSON object)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from rollover.config import ConfigError, load_config
from rollover.simulate.distributions import Constant, Distribution, Exponential, LogNormal, Pareto, load_durations
from rollover.simulate.ideal import ideal_step_seconds
from rollover.simulate.planner import DEFAULT_WINDOWS, Scenario, SimulationResult, recommend, sweep, window_sizes
from rollover.training.trainer import DrainTimeout

T = TypeVar("T")


def _argument(convert: Callable[[str], T], expected: str, ok: Callable[[T], bool], rule: str) -> Callable[[str], T]:
    """An argparse `type=`: `convert`, then check `ok`; both errors say what was expected."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


def _count(minimum: int) -> Callable[[str], int]:
    return _argument(int, "an integer", lambda value: value >= minimum, f">= {minimum}")


_seconds = _argument(
    float, "a number of seconds", lambda value: math.isfinite(value) and value >= 0, "a finite number >= 0"
)
_fraction = _argument(float, "a number", lambda value: 0 <= value < 1, "in [0, 1)")


_PARAMS = {
    "lognormal": ("median", "sigma"),
    "exponential": ("mean",),
    "pareto": ("scale", "alpha"),
    "constant": ("duration",),
    "empirical": (),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollover simulate",
        description=(
            "Capacity planner: runs the real trainer loop in virtual time with simulated rollout "
            "durations, for sync mode and a sweep of async windows, and recommends "
            "agentlightning.async_rollout.async_train_batch_size."
        ),
    )
    parser.add_argument("--batch-size", type=_count(1), default=32, help="data.train_batch_size (default 32)")
    parser.add_argument("--n", type=_count(1), default=4, help="actor_rollout_ref.rollout.n (default 4)")
    parser.add_argument(
        "--windows", default=",".join(f"{m:g}" for m in DEFAULT_WINDOWS), help="window sizes as multiples of the batch"
    )
    parser.add_argument("--distribution", choices=sorted(_PARAMS), default=None, help="default lognormal")
    parser.add_argument("--median", type=float, help="lognormal median seconds (default 1)")
    parser.add_argument("--sigma", type=float, help="lognormal sigma (default 1)")
    parser.add_argument("--mean", type=float, help="exponential mean seconds (default 1)")
    parser.add_argument("--scale", type=float, help="pareto minimum seconds (default 1)")
    parser.add_argument("--alpha", type=float, help="pareto shape, > 1 (default 2)")
    parser.add_argument("--duration", type=float, help="constant seconds (default 1)")
    parser.add_argument(
        "--durations",
        metavar="FILE_OR_RUN_DIR",
        help='measured durations: JSONL of {"duration_s": x}, or a run folder (reads its store.db)',
    )
    parser.add_argument("--capacity", type=_count(1), default=None, help="max concurrent rollouts (default batch*n)")
    parser.add_argument("--steps", type=_count(1), default=100, help="updates per simulation (default 100)")
    parser.add_argument("--update-seconds", type=_seconds, default=1.0, help="time of one policy update (default 1)")
    parser.add_argument("--sync-seconds", type=_seconds, default=0.0, help="time of one weight sync (default 0)")
    parser.add_argument("--drain-seconds", type=_seconds, default=0.0, help="time a pause takes to drain (default 0)")
    parser.add_argument(
        "--pause-freezes-rollouts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rollouts make no progress during update and sync (collocated engine; default on)",
    )
    parser.add_argument(
        "--max-carry-over-age",
        type=_count(0),
        default=None,
        help="the trainer's agentlightning.async_rollout.max_carry_over_age_steps (default none)",
    )
    parser.add_argument(
        "--max-staleness",
        type=_count(0),
        default=4,
        help="recommend no window whose max carry-over age exceeds this (default 4)",
    )
    parser.add_argument(
        "--tolerance",
        type=_fraction,
        default=0.05,
        help="throughput within this fraction of the best counts as best (default 0.05)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def _distribution(args: argparse.Namespace) -> Distribution:
    kind = args.distribution or ("empirical" if args.durations else "lognormal")
    if args.durations and kind != "empirical":
        raise ValueError(f"--durations reads measured durations; it cannot be combined with --distribution {kind}")
    if kind == "empirical" and not args.durations:
        raise ValueError("--distribution empirical needs --durations FILE_OR_RUN_DIR")
    for kind_name, names in _PARAMS.items():
        for name in names:
            if kind_name != kind and name not in _PARAMS[kind] and getattr(args, name) is not None:
                raise ValueError(f"--{name} applies to --distribution {kind_name}, not {kind}")

    def given(name: str, default: float) -> float:
        value = getattr(args, name)
        return default if value is None else value

    if kind == "lognormal":
        return LogNormal(given("median", 1.0), given("sigma", 1.0))
    if kind == "exponential":
        return Exponential(given("mean", 1.0))
    if kind == "pareto":
        return Pareto(given("scale", 1.0), given("alpha", 2.0))
    if kind == "constant":
        return Constant(given("duration", 1.0))
    return load_durations(args.durations)


def _multipliers(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--windows must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError("--windows needs at least one multiplier")
    return values


def _table(scenario: Scenario, results: Sequence[SimulationResult]) -> str:
    # Aborts happen only under the trainer's staleness cap; the column would be noise otherwise.
    aborts = any(r.n_aborted_stale_rollouts for r in results)
    header = f"{'mode':<12}{'window':>7}{'updates/h':>11}{'rollouts/s':>12}{'idle':>7}{'age mean':>10}{'age max':>9}{'lag mean':>10}"
    header += f"{'aborted':>9}" if aborts else ""
    lines = [header, "-" * len(header)]
    for r in results:
        label = "sync" if not r.async_enabled else f"async {r.window / scenario.batch_size:g}x"
        line = (
            f"{label:<12}{r.window:>7}{r.updates_per_hour:>11.1f}{r.rollouts_per_second:>12.2f}"
            f"{r.idle_fraction:>7.0%}{r.mean_carry_over_age:>10.2f}{r.max_carry_over_age:>9}{r.mean_version_lag:>10.2f}"
        )
        lines.append(line + (f"{r.n_aborted_stale_rollouts:>9}" if aborts else ""))
    return "\n".join(lines)


def _recommendation_text(results: Sequence[SimulationResult], choice: SimulationResult, max_staleness: int) -> str:
    sync = results[0]
    gain = choice.updates_per_hour / sync.updates_per_hour
    if choice.async_enabled:
        text = (
            "recommended: agentlightning.async_rollout.enabled=true "
            f"agentlightning.async_rollout.async_train_batch_size={choice.window}  "
            f"({gain:.2f}x sync throughput, max carry-over age {choice.max_carry_over_age} <= {max_staleness})"
        )
    else:
        text = "recommended: synchronous (agentlightning.async_rollout.enabled=false)"
    best = max(results, key=lambda r: r.updates_per_hour)
    if best.max_carry_over_age > max_staleness and best.updates_per_hour > choice.updates_per_hour:
        text += (
            f"\nnote: window {best.window} is {best.updates_per_hour / choice.updates_per_hour:.2f}x faster but its max "
            f"carry-over age {best.max_carry_over_age} exceeds --max-staleness {max_staleness}; raise it, or cap the "
            "trainer with --max-carry-over-age (agentlightning.async_rollout.max_carry_over_age_steps)"
        )
    return text


def main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage and the message (or the help)
        return int(exc.code or 0)
    try:
        overrides = (
            (f"agentlightning.async_rollout.max_carry_over_age_steps={args.max_carry_over_age}",)
            if args.max_carry_over_age is not None
            else ()
        )
        scenario = Scenario(
            distribution=_distribution(args),
            batch_size=args.batch_size,
            n=args.n,
            capacity=args.capacity,
            steps=args.steps,
            update_seconds=args.update_seconds,
            sync_seconds=args.sync_seconds,
            drain_seconds=args.drain_seconds,
            seed=args.seed,
            pause_freezes_rollouts=args.pause_freezes_rollouts,
            overrides=overrides,
        )
        multipliers = _multipliers(args.windows)
        window_sizes(scenario.batch_size, multipliers)  # reject bad multipliers before any run
        load_config(None, overrides)
    except (ValueError, ConfigError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2

    try:
        results = sweep(scenario, multipliers)
    except DrainTimeout as exc:  # the trainer itself would stop here: say so, as a real run would
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    choice = recommend(results, args.max_staleness, args.tolerance)
    sync_step, async_step = ideal_step_seconds(
        scenario.distribution,
        scenario.batch_size,
        scenario.n,
        scenario.update_seconds + scenario.sync_seconds,
        scenario.agents,
        scenario.pause_freezes_rollouts,
        seed=scenario.seed,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "distribution": scenario.distribution.describe(),
                    "batch_size": scenario.batch_size,
                    "n": scenario.n,
                    "capacity": scenario.agents,
                    "steps": scenario.steps,
                    "update_seconds": scenario.update_seconds,
                    "sync_seconds": scenario.sync_seconds,
                    "drain_seconds": scenario.drain_seconds,
                    "pause_freezes_rollouts": scenario.pause_freezes_rollouts,
                    "seed": scenario.seed,
                    "results": [r.to_json() for r in results],
                    "ideal_speedup": sync_step / async_step,
                    "ideal_sync_step_seconds": sync_step,
                    "ideal_async_step_seconds": async_step,
                    "recommended_window": choice.window if choice.async_enabled else None,
                }
            )
        )
        return 0
    freeze = "frozen" if scenario.pause_freezes_rollouts else "running"
    print(
        f"{scenario.distribution.describe()}; batch {scenario.batch_size} groups x n {scenario.n}; "
        f"capacity {scenario.agents} rollouts; {scenario.steps} updates of {scenario.update_seconds:g}s "
        f"+ sync {scenario.sync_seconds:g}s; rollouts {freeze} during updates"
    )
    print(_table(scenario, results))
    k = scenario.batch_size * scenario.n
    rollout_phase = f"{k} x mean duration / {scenario.agents} agents"
    ideal = f"{rollout_phase} + update" if scenario.pause_freezes_rollouts else f"max({rollout_phase}, update)"
    print(
        f"ideal async speed-up: {sync_step / async_step:.2f}x  "
        f"(sync step {sync_step:.2f}s = slowest of {k} rollouts + update; ideal async step {async_step:.2f}s = {ideal})"
    )
    print(_recommendation_text(results, choice, args.max_staleness))
    return 0
