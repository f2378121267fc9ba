"""The holes of issue 12: forged model calls, the admin key in argv, an open schema, keys
that outlive their attempt."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayProcess
from tests.conftest import ADMIN_KEY
from tests.gateway.test_bad_input import assert_refused, proxy_path, running, store_dump


@pytest.mark.parametrize("who", ["agent", "admin"])
def test_model_request_events_are_written_only_by_the_proxy(gateway, admin, who):
    rid = running(admin)
    headers = {"x-api-key": scoped_key(ADMIN_KEY, rid, "a1") if who == "agent" else ADMIN_KEY}
    url = f"{gateway.url}/api/rollouts/{rid}/attempt/a1/events"
    before = store_dump(admin)
    forged = {"prompt_token_ids": [1], "response_token_ids": [2], "response_logprobs": [0.0], "policy_version": 9}
    refused = assert_refused(
        httpx.post(url, json={"event_type": "model_request", "data": forged}, headers=headers), 403
    )
    assert "proxy" in refused["reason"]
    assert store_dump(admin) == before
    assert admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"] == []
    assert httpx.post(url, json={"event_type": "tool_call", "data": {"n": 1}}, headers=headers).status_code == 201


def test_the_gateway_process_gets_its_admin_key_outside_argv_and_environment(tmp_path: Path):
    key = "ak-never-in-proc-cmdline-0123456789"
    with GatewayProcess(store=str(tmp_path / "store.db"), admin_key=key) as gateway:
        assert gateway.process is not None
        proc = Path(f"/proc/{gateway.process.pid}")
        assert key.encode() not in (proc / "cmdline").read_bytes()
        assert key.encode() not in (proc / "environ").read_bytes()
        assert httpx.get(f"{gateway.url}/api/rollouts", headers={"x-api-key": key}).status_code == 200
        assert httpx.get(f"{gateway.url}/api/rollouts", headers={"x-api-key": "guess"}).status_code == 401


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_schema_and_its_pages_need_the_admin_key(gateway, admin, path):
    rid = running(admin)
    assert_refused(httpx.get(gateway.url + path), 401)
    assert_refused(httpx.get(gateway.url + path, headers={"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")}), 403)
    served = admin.get(path)
    assert served.status_code == 200
    if path == "/openapi.json":
        assert "/api/rollouts" in served.json()["paths"]
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200  # the one open endpoint


def test_a_finished_attempts_key_writes_nothing_while_a_later_attempt_runs(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running(admin)  # attempt a1
    old = {"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")}
    reward = {"event_type": "reward", "data": {"value": 0.5}}
    events = f"{gateway.url}/api/rollouts/{rid}/attempt/{{}}/events"
    assert httpx.post(events.format("a1"), json=reward, headers=old).status_code == 201
    # a1 fails and the rollout is retried as a2
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "queuing", "error_message": "exit code 1"}})
    assert_refused(httpx.post(events.format("a1"), json=reward, headers=old), 409)  # queued: a1 is over
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a2"}})
    before = store_dump(admin)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    a2_proxy = proxy_path(rid).replace("/attempt/a1/", "/attempt/a2/")
    assert "over" in assert_refused(httpx.post(events.format("a1"), json=reward, headers=old), 409)["reason"]
    assert_refused(httpx.post(gateway.url + proxy_path(rid), json=chat, headers=old), 409)
    assert_refused(httpx.post(events.format("a2"), json=reward, headers=old), 403)  # not its attempt
    assert_refused(httpx.post(gateway.url + a2_proxy, json=chat, headers=old), 403)
    assert store_dump(admin) == before and not stub.behaviour.requests
    assert httpx.get(f"{gateway.url}/api/rollouts/{rid}", headers=old).status_code == 200  # reading stays open
    # the running attempt's own key writes
    new = {"x-api-key": scoped_key(ADMIN_KEY, rid, "a2")}
    assert httpx.post(events.format("a2"), json=reward, headers=new).status_code == 201
    assert httpx.post(gateway.url + a2_proxy, json=chat, headers=new).status_code == 200
    assert_refused(httpx.post(events.format("a1"), json=reward, headers=new), 403)


def test_attempt_keys_differ_per_rollout_and_attempt():
    keys = {scoped_key(ADMIN_KEY, r, a) for r in ("r1", "r1:a", "r") for a in ("a1", "a2", "1:a1")}
    assert len(keys) == 9
