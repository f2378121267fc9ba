"""`rollover report RUN_DIR`: one PNG with reward, the async metrics and timing over steps."""

from __future__ import annotations

from pathlib import Path

from rollover.metrics import read_jsonl

PANELS = (
    ("reward", ("reward/mean", "val/reward_mean")),
    (
        "carry-over (rollouts)",
        (
            "training/async/n_prev_carry_over_rollouts",
            "training/async/n_completed_rollouts",
            "training/async/n_new_carry_over_rollouts",
        ),
    ),
    ("staleness", ("training/async/new_carry_over_age_max_steps", "policy/version_lag_mean", "policy/version_lag_max")),
    ("drain", ("training/async/proxy_drain_seconds", "training/async/proxy_inflight_at_pause")),
    (
        "rollout time (s)",
        ("timing/rollout_queue_wait_s/mean", "timing/rollout_run_duration_s/mean", "timing/rollout_run_duration_s/max"),
    ),
    ("step time (s)", ("timing/step_s", "timing/update_s", "timing/weight_sync_s", "timing/trainer_idle_s")),
)


class ReportError(ValueError):
    pass


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} not found: is {run_dir} a run folder written with the jsonl logger?")
    rows = read_jsonl(metrics_path)
    if not rows:
        raise ReportError(f"{metrics_path} is empty")
    out = Path(out) if out else run_dir / "report.png"
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    plotted = 0
    for axis, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(row["step"], row[key]) for row in rows if key in row]
            if points:
                steps, values = zip(*points)
                axis.plot(steps, values, marker="o", markersize=3, label=key)
                plotted += 1
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.lines:
            axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    if plotted == 0:
        plt.close(figure)
        raise ReportError(f"{metrics_path} has none of the metrics a report plots")
    figure.suptitle(f"Rollover run {run_dir.name}")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
