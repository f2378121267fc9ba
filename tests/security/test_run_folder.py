"""The run folder is its user's alone, and nothing it keeps holds a key in clear."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml

from rollover.config import dump_config, redacted, validate_config
from rollover.launch import prepare_run_dir, write_private


def test_the_run_folder_is_0700_and_the_config_file_0600_without_keys(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "calc"
    config = validate_config(
        {
            "trainer": {"default_local_dir": str(tmp_path / "runs"), "experiment_name": "calc"},
            "gateway": {"admin_key": "admin-secret-123"},
        }
    )
    assert prepare_run_dir(config) == run_dir
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    write_private(run_dir / "config.yaml", dump_config(config))
    assert stat.S_IMODE((run_dir / "config.yaml").stat().st_mode) == 0o600
    text = (run_dir / "config.yaml").read_text()
    assert "admin-secret-123" not in text
    assert yaml.safe_load(text)["gateway"]["admin_key"] == "<redacted>"
    # What W&B is given is the same redacted data; the config itself keeps its key.
    assert "admin-secret-123" not in str(redacted(config))
    assert config.gateway.admin_key == "admin-secret-123"
