import json

import matplotlib.image as mpimg
import pytest

from rollover.cli.main import main
from rollover.metrics import MetricsLogger, read_jsonl, summarize
from rollover.metrics.report import write_report


def test_summarize_quantiles():
    values = [float(v) for v in range(1, 11)]
    s = summarize("timing/x", values)
    assert s == {"timing/x/mean": 5.5, "timing/x/p50": 5.0, "timing/x/p90": 9.0, "timing/x/max": 10.0}
    assert summarize("t", []) == {}


@pytest.mark.slow
def test_jsonl_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(tmp_path, ["jsonl", "wandb", "console"], experiment="t")
    logger.log(1, {"reward/mean": 0.5, "training/async/proxy_drain_seconds": 0.1, "bad": float("nan")})
    logger.close()
    [row] = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["step"] == 1 and row["reward/mean"] == 0.5 and "bad" not in row
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def recorded_run(tmp_path):
    rows = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "training/async/n_new_carry_over_rollouts": 4 - s % 3,
            "timing/step_s": 2.0 + s,
        }
        for s in range(1, 8)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


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
