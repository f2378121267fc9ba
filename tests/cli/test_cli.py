"""The `rollover` command: exit codes and one clear line on stderr for bad input."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def rollover(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "rollover.cli.main", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_help_lists_every_command():
    result = rollover("--help")
    assert result.returncode == 0
    for command in ("train", "gateway", "controller", "config", "model", "simulate", "report"):
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


def test_config_defaults_prints_the_shipped_defaults():
    result = rollover("config", "defaults")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "rollover" / "configs" / "default.yaml").read_text()


def test_config_show_prints_the_merged_validated_config():
    result = rollover("config", "show", "examples/calc/config.yaml", "data.train_batch_size=3")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["data"]["train_batch_size"] == 3
    assert shown["trainer"]["setup_hook"] == "examples.calc.prepare:prepare"  # from the file
    assert shown["gateway"]["max_body_bytes"] == 16 * 1024 * 1024  # from the defaults
    assert "# completed prompt groups consumed by one update" in result.stdout
    only_overrides = rollover("config", "show", "gateway.port=8080")
    assert yaml.safe_load(only_overrides.stdout)["gateway"]["port"] == 8080


def test_config_show_bad_key_is_exit_2_with_one_line():
    result = rollover("config", "show", "examples/calc/config.yaml", "gateway.prot=1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown config key 'gateway.prot'" in lines[0]


def test_gateway_alone_takes_its_defaults_from_the_config(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "rollover.cli.main", "gateway", "gateway.max_body_bytes=1000"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        key = url = None
        for line in process.stderr:  # the key, then the URL, once the server is built
            key = line.split(": ", 1)[1].strip() if line.startswith("admin key: ") else key
            if line.startswith("gateway http://"):
                url = line.split()[1]
                break
        assert key and url and not url.endswith(":0"), "port 0 = a free port, printed"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        response = httpx.post(f"{url}/api/rollouts", content=b" " * 2000, headers={"x-api-key": key}, timeout=10)
        assert response.status_code == 413 and "1000" in response.json()["reason"]
        assert (tmp_path / "store.db").is_file()  # store: null = store.db in the working directory
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--port", "70000"], "config key 'gateway.port'"),
        (["gateway.upstream_retries=-1"], "config key 'gateway.upstream_retries'"),
        (["--settings-stdin", "gateway.port=1"], "--settings-stdin"),
    ],
)
def test_gateway_bad_settings_are_exit_2_with_one_line(args, needle):
    result = rollover("gateway", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


@pytest.mark.parametrize(
    "failure,needle",
    [
        ("gateway", "rollover train: the gateway died and 3 restart(s) did not bring it back"),
        ("transport", "rollover train: the gateway stopped answering: ConnectError('refused')"),
    ],
)
def test_train_that_loses_its_gateway_is_exit_1_with_one_line(monkeypatch, capsys, failure, needle):
    from rollover import launch
    from rollover.cli import logs
    from rollover.cli.main import main
    from rollover.gateway.server import GatewayDied

    def run_training(config, **kwargs):
        if failure == "gateway":
            raise GatewayDied("the gateway died and 3 restart(s) did not bring it back (gateway.max_restarts=3): x")
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(launch, "run_training", run_training)
    monkeypatch.setattr(logs, "configure_logging", lambda *args, **kwargs: None)
    assert main(["train", str(ROOT / "examples/calc/config.yaml")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(needle), lines
