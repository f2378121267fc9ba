"""The `rollover` command: exit codes and one clear line on stderr for bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rollover(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "rollover.cli.main", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_help_lists_every_command():
    result = rollover("--help")
    assert result.returncode == 0
    for command in ("train", "gateway", "controller", "model", "simulate", "report"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "override,needle",
    [
        ("data.train_batch_size=-1", "data.train_batch_size"),
        ("data.train_bath_size=4", "unknown config key 'data.train_bath_size'"),
        ("algorithm.rollout_correction.rollout_is=tokens", "algorithm.rollout_correction.rollout_is"),
        ("agentlightning.async_rollout.enabled=true", "async_train_batch_size=None, train_batch_size=4"),
    ],
)
def test_train_bad_config_is_exit_2_with_one_line(override, needle):
    result = rollover("train", "examples/calc/config.yaml", override)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_train_missing_config_file():
    result = rollover("train", "does/not/exist.yaml")
    assert result.returncode == 2 and "config file not found" in result.stderr


def test_controller_bad_agent_class_names_the_key():
    result = rollover(
        "controller",
        "--gateway",
        "http://127.0.0.1:9",
        "--key",
        "k",
        "agentlightning.local.agent_class=no_such_module:Agent",
    )
    assert result.returncode == 2
    assert "agentlightning.local.agent_class" in result.stderr
