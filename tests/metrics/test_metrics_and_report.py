import json

import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import pytest

from rollover.cli.main import main
from rollover.config import dump_config, load_config
from rollover.metrics import MetricsLogger, read_jsonl, summarize
from rollover.metrics.report import build_figure, run_label, write_report


def test_summarize_quantiles():
    values = [float(v) for v in range(1, 11)]
    s = summarize("timing/x", values)
    assert s == {"timing/x/mean": 5.5, "timing/x/p50": 5.0, "timing/x/p90": 9.0, "timing/x/max": 10.0}
    assert summarize("t", []) == {}


@pytest.mark.slow
def test_jsonl_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(tmp_path, ["jsonl", "wandb", "console"], experiment="t")
    logger.log(1, {"critic/score/mean": 0.5, "training/async/proxy_drain_seconds": 0.1, "bad": float("nan")})
    logger.close()
    [row] = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["step"] == 1 and row["critic/score/mean"] == 0.5 and "bad" not in row
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def recorded_run(tmp_path):
    rows = [
        {
            "step": s,
            "critic/score/mean": 0.1 * s,
            "training/async/n_new_carry_over_rollouts": 4 - s % 3,
            "timing/step_s": 2.0 + s,
        }
        for s in range(1, 8)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_a_row_torn_by_a_kill_is_cut_before_the_resumed_run_appends(tmp_path):
    whole = json.dumps({"step": 1, "time": 0.0, "actor/pg_loss": 0.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 2, "time": 1.0, "actor/pg')
    logger = MetricsLogger(tmp_path, ["jsonl"])
    logger.log(2, {"actor/pg_loss": 0.25})
    logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["actor/pg_loss"]) for r in rows] == [(1, 0.5), (2, 0.25)]


def test_report_png_has_axes_with_data(tmp_path):
    out = write_report(recorded_run(tmp_path))
    image = mpimg.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 800
    # a plot with data is far from a blank page: many distinct colours
    assert image.reshape(-1, image.shape[-1]).std(axis=0).max() > 0.05


def test_report_cli_errors_are_clear(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    assert main(["report", str(recorded_run(tmp_path))]) == 0
    assert (tmp_path / "report.png").stat().st_size > 10_000


def evaluated_run(tmp_path, config=True):
    """Training metrics at steps 0..10, held-out ones at 0, 5 and 10, and the launcher's config.yaml."""
    rows = [{"step": s, "critic/score/mean": 0.05 * s, "timing/step_s": 1.0 + s} for s in range(11)]
    for row in rows:
        if row["step"] in (0, 5, 10):
            row |= {"val/reward_mean": 0.2 + 0.02 * row["step"], "val/accuracy": 0.3 + 0.03 * row["step"]}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config:
        overrides = [
            "agentlightning.async_rollout.enabled=true",
            "agentlightning.async_rollout.async_train_batch_size=8",
            "data.train_batch_size=4",
            "actor_rollout_ref.model.path=/models/SmolLM2-135M-Instruct",
            "actor_rollout_ref.model.served_model_name=smol",
        ]
        (tmp_path / "config.yaml").write_text(dump_config(load_config(None, overrides)))
    return tmp_path


def lines_by_label(figure):
    return {line.get_label(): line for axis in figure.axes for line in axis.get_lines()}


def test_report_draws_held_out_points_as_markers_and_names_mode_and_model(tmp_path):
    figure = build_figure(evaluated_run(tmp_path))
    try:
        lines = lines_by_label(figure)
        for key in ("val/reward_mean", "val/accuracy"):
            held_out = lines[f"{key} (held-out)"]
            assert list(held_out.get_xdata()) == [0, 5, 10]
            assert held_out.get_linestyle() == "None" and held_out.get_marker() not in (None, "None", "", " ")
        train = lines["critic/score/mean"]
        assert list(train.get_xdata()) == list(range(11)) and train.get_linestyle() == "-"
        title = figure.get_suptitle()
        assert "async (async_train_batch_size=8, train_batch_size=4)" in title
        assert "SmolLM2-135M-Instruct" in title and "/models" not in title and "smol" in title
    finally:
        plt.close(figure)


def test_report_cli_prints_held_out_values_and_mode_model(tmp_path, capsys):
    assert main(["report", str(evaluated_run(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "mode: async" in out and "model: SmolLM2-135M-Instruct (served as smol)" in out
    assert "held-out at step 0: reward_mean 0.200, accuracy 0.300" in out
    assert "held-out at step 5: reward_mean 0.300, accuracy 0.450" in out
    assert "held-out at step 10: reward_mean 0.400, accuracy 0.600" in out


def test_report_without_config_says_unknown(tmp_path, capsys):
    run = evaluated_run(tmp_path, config=False)
    figure = build_figure(run)
    try:
        assert "mode: unknown" in figure.get_suptitle() and "model: unknown" in figure.get_suptitle()
    finally:
        plt.close(figure)
    assert main(["report", str(run)]) == 0
    assert "mode: unknown · model: unknown" in capsys.readouterr().out
    assert (run / "report.png").stat().st_size > 10_000


def test_report_names_sync_mode(tmp_path):
    run = evaluated_run(tmp_path, config=False)
    (run / "config.yaml").write_text(dump_config(load_config(None, ["data.train_batch_size=4"])))
    assert run_label(run).startswith("mode: sync (train_batch_size=4)")


def test_every_panel_is_drawn_and_policies_get_their_own(tmp_path):
    import matplotlib.pyplot as plt

    from rollover.metrics.report import PANELS

    rows = [
        {"step": step, "critic/score/mean": 0.1 * step, "actor/entropy": 1.0 / step}
        | {f"policy/{name}/reward_mean": 0.2 * step for name in ("planner", "solver")}
        | {f"policy/{name}/actor/entropy": 0.5 for name in ("planner", "solver")}
        for step in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figure = build_figure(tmp_path)
    titles = [axis.get_title() for axis in figure.axes if axis.get_visible()]
    plt.close(figure)
    assert titles == [title for title, _ in PANELS] + ["policies"]
    policies = next(axis for axis in figure.axes if axis.get_title() == "policies")
    assert {line.get_label() for line in policies.lines} == {
        f"policy/{name}/{key}" for name in ("planner", "solver") for key in ("reward_mean", "actor/entropy")
    }
