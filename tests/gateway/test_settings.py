"""The gateway process gets its settings whole: every gateway key and both temperatures reach it."""

import httpx
import pytest

from rollover.config import ConfigError, GatewaySettings, load_config
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayProcess, GatewayThread
from tests.conftest import ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _running_rollout(client: httpx.Client) -> str:
    [rollout] = client.post("/api/rollouts", json=[{"input": {}}], headers=ADMIN).json()
    running = {"status": {"state": "running", "last_attempt_id": "a1"}}
    client.patch(f"/api/rollouts/{rollout['rollout_id']}", json=running, headers=ADMIN)
    return rollout["rollout_id"]


def test_a_gateway_process_runs_with_the_config_it_was_given(tmp_path, stub):
    config = load_config(
        None,
        [
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.2",
            "gateway.max_body_bytes=2000",
            "gateway.retry_after_seconds=2",
            "gateway.upstream_retries=0",
        ],
    )
    settings = GatewaySettings.from_config(config, store=str(tmp_path / "g.db"), admin_key=ADMIN_KEY)
    with GatewayProcess(settings) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert gateway.settings.gateway.port > 0  # port 0 = a free one, picked before the process starts
        client.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}], headers=ADMIN)
        rid = _running_rollout(client)
        agent = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}
        for mode, temperature in (("train", 0.7), ("val", 0.2)):
            url = f"/proxy/rollout/{rid}/attempt/a1/mode/{mode}/openai/v1/chat/completions"
            assert client.post(url, json={"messages": [], "temperature": 1.5}, headers=agent).status_code == 200
            assert stub.behaviour.requests[-1]["temperature"] == temperature

        stub.behaviour.fail_next = 1  # upstream_retries=0: the first 500 is the answer
        before = len(stub.behaviour.requests)
        assert client.post(url, json={"messages": []}, headers=agent).status_code == 502
        assert len(stub.behaviour.requests) == before + 1

        big = client.post("/api/rollouts", content=b"[" + b" " * 3000 + b"]", headers=ADMIN)
        assert big.status_code == 413 and "2000" in big.json()["reason"]

        client.post("/proxy/pause", json={}, headers=ADMIN)
        refused = client.post(url, json={"messages": []}, headers=agent)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
    assert (tmp_path / "g.db").is_file()


def test_thread_keywords_replace_gateway_keys_and_bad_ones_name_the_key():
    with GatewayThread(admin_key=ADMIN_KEY, retry_after_seconds=3) as gateway:
        assert gateway.settings.gateway.store == ":memory:"
        state = httpx.post(f"{gateway.url}/proxy/pause", json={}, headers=ADMIN).json()
        assert state["retry_after_seconds"] == 3.0
    with pytest.raises(ConfigError, match=r"config key 'gateway\.max_body_bytes'"):
        GatewayThread(max_body_bytes=0)
    with pytest.raises(ConfigError, match=r"unknown config key 'gateway\.max_body'"):
        GatewaySettings.from_config(max_body=10)


def test_settings_take_the_run_config_whole():
    config = load_config(None, ["gateway.upstream_timeout_seconds=7", "actor_rollout_ref.rollout.temperature=0.5"])
    settings = GatewaySettings.from_config(config)
    assert settings.gateway == config.gateway and settings.gateway is not config.gateway
    assert (settings.train_temperature, settings.val_temperature) == (0.5, 0.0)
    assert GatewaySettings.model_validate_json(settings.model_dump_json()) == settings
