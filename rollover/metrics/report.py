"""`rollover report RUN_DIR`: one PNG with reward, the async metrics and timing over steps.

Training curves are lines; held-out evaluations (`val/*`, logged only at the start, every
`trainer.test_freq` steps and the end) are markers at the steps they were measured. The title
names the run's mode and model, read from the `config.yaml` the launcher writes beside the metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rollover.metrics import read_jsonl

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANELS = (
    ("reward", ("critic/score/mean", "val/reward_mean", "val/accuracy")),
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
    ("policy", ("actor/entropy", "actor/pg_clipfrac", "actor/kl_loss", "training/n_filtered_groups")),
)
HELD_OUT = ("val/reward_mean", "val/accuracy")


def _policy_panels(rows: list[dict[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    """A run of several policies (`policy/<name>/...` metrics): one panel, each policy's
    training reward and entropy."""
    names = sorted(
        {key.split("/")[1] for row in rows for key in row if key.endswith("/reward_mean") and key.startswith("policy/")}
    )
    if not names:
        return []
    keys = tuple(key for name in names for key in (f"policy/{name}/reward_mean", f"policy/{name}/actor/entropy"))
    return [("policies", keys)]


class ReportError(ValueError):
    pass


def _get(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def run_label(run_dir: str | Path) -> str:
    """`mode: … · model: …` from RUN_DIR/config.yaml; says unknown where the file or a key is missing."""
    path = Path(run_dir) / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        config = None
    if not isinstance(config, dict):
        return "mode: unknown · model: unknown (no readable config.yaml)"
    enabled = _get(config, "agentlightning.async_rollout.enabled")
    train = _get(config, "data.train_batch_size")
    if enabled is None:
        mode = "mode: unknown"
    elif enabled:
        window = _get(config, "agentlightning.async_rollout.async_train_batch_size")
        mode = f"mode: async (async_train_batch_size={window}, train_batch_size={train})"
    else:
        mode = f"mode: sync (train_batch_size={train})"
    model_path = _get(config, "actor_rollout_ref.model.path")
    model = f"model: {Path(str(model_path)).name}" if model_path else "model: unknown"
    served = _get(config, "actor_rollout_ref.model.served_model_name")
    if served:
        model += f" (served as {served})"
    return f"{mode} · {model}"


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} not found: is {run_dir} a run folder written with the jsonl logger?")
    rows = read_jsonl(metrics_path)
    if not rows:
        raise ReportError(f"{metrics_path} is empty")
    return rows


def build_figure(run_dir: str | Path) -> Figure:
    """The report's figure (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = _rows(run_dir)
    panels = [*PANELS, *_policy_panels(rows)]
    n_rows = -(-len(panels) // 3)
    figure, axes = plt.subplots(n_rows, 3, figsize=(15, 4 * n_rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    plotted = 0
    for axis, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            points = [(row["step"], row[key]) for row in rows if key in row]
            if not points:
                continue
            steps, values = zip(*points)
            if key in HELD_OUT:
                # measured at a few steps only: points, not a line joining the first and the last
                axis.plot(steps, values, linestyle="none", marker="D", markersize=7, label=f"{key} (held-out)")
            else:
                axis.plot(steps, values, marker="o", markersize=3, label=key)
            plotted += 1
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.lines:
            axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    if plotted == 0:
        plt.close(figure)
        raise ReportError(f"{run_dir / 'metrics.jsonl'} has none of the metrics a report plots")
    figure.suptitle(f"Rollover run {run_dir.name}\n{run_label(run_dir)}")
    figure.tight_layout()
    return figure


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib.pyplot as plt

    figure = build_figure(run_dir)
    out = Path(out) if out else Path(run_dir) / "report.png"
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def summary_text(run_dir: str | Path) -> str:
    """The mode/model line and the held-out values at each evaluated step."""
    run_dir = Path(run_dir)
    lines = [run_label(run_dir)]
    evaluated = [row for row in _rows(run_dir) if any(key in row for key in HELD_OUT)]
    if not evaluated:
        lines.append("held-out: none logged")
    for row in evaluated:
        values = ", ".join(f"{key.removeprefix('val/')} {row[key]:.3f}" for key in HELD_OUT if key in row)
        lines.append(f"held-out at step {row['step']}: {values}")
    return "\n".join(lines)
