"""The recording proxy against a stand-in upstream, and the pause/drain contract."""

import math
import socket
import threading
import time

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY


def running_rollout(admin, is_train=True):
    r = admin.post("/api/rollouts", json=[{"input": {}, "is_train": is_train}]).json()[0]
    admin.patch(f"/api/rollouts/{r['rollout_id']}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
    return r["rollout_id"]


def proxy_url(gateway, rollout_id, mode="train", endpoint="chat/completions"):
    return f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/a1/mode/{mode}/openai/v1/{endpoint}"


def agent_headers(rollout_id):
    return {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rollout_id, 'a1')}"}


def wait_inflight(admin, timeout=30.0):
    deadline = time.monotonic() + timeout
    while admin.get("/proxy/state").json()["inflight"] == 0:
        assert time.monotonic() < deadline, "the call never reached the gateway"
        time.sleep(0.01)


@pytest.fixture
def registered(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 7}])
    return stub


def test_chat_call_is_forced_and_recorded(gateway, admin, registered):
    rid = running_rollout(admin)
    body = {"model": "whatever", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.3}
    response = httpx.post(proxy_url(gateway, rid), json=body, headers=agent_headers(rid))
    assert response.status_code == 200, response.text
    sent = registered.behaviour.requests[-1]
    assert sent["model"] == "policy" and sent["temperature"] == 1.0
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert (sent["top_p"], sent["top_k"], sent["min_p"]) == (1.0, -1, 0.0)
    [event] = admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    data = event["data"]
    assert data["policy_version"] == 7 and data["latency_s"] > 0 and data["mode"] == "train"
    assert data["response_token_ids"] == response.json()["choices"][0]["token_ids"]
    assert data["prompt_token_ids"] == response.json()["prompt_token_ids"]
    assert data["response_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert data["request"] == body
    triplets = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"]
    assert triplets[0]["policy_version"] == 7


def test_completions_and_val_mode(gateway, admin, registered):
    rid = running_rollout(admin, is_train=False)
    response = httpx.post(
        proxy_url(gateway, rid, mode="val", endpoint="completions"), json={"prompt": "2+2="}, headers=agent_headers(rid)
    )
    assert response.status_code == 200
    sent = registered.behaviour.requests[-1]
    assert sent["temperature"] == 0.0 and sent["return_token_ids"] is True and "logprobs" not in sent
    [event] = admin.get(f"/api/rollouts/{rid}/events").json()
    assert event["data"]["response_token_ids"] == response.json()["choices"][0]["token_ids"]


def test_stream_requests_get_server_sent_events(gateway, admin, registered):
    rid = running_rollout(admin)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = httpx.post(proxy_url(gateway, rid), json=body, headers=agent_headers(rid))
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"delta"' in lines[0]
    assert (
        registered.behaviour.requests[-1]["stream"] is True
    )  # relayed from the engine (tests/gateway/test_streaming.py)


def test_upstream_5xx_is_retried(gateway, admin, registered):
    registered.behaviour.fail_next = 2
    rid = running_rollout(admin)
    response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid), timeout=30)
    assert response.status_code == 200
    assert len(registered.behaviour.requests) == 3
    assert len(admin.get(f"/api/rollouts/{rid}/events").json()) == 1


@pytest.mark.slow
def test_unreachable_upstream_is_a_clear_json_error(gateway, admin):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    admin.post("/api/models", json=[{"model": "policy", "endpoint": f"http://127.0.0.1:{dead_port}/v1"}])
    rid = running_rollout(admin)
    response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid), timeout=30)
    assert response.status_code == 503
    assert response.json()["error"] == "upstream error" and "unreachable" in response.json()["reason"]
    assert admin.get("/proxy/state").json()["inflight"] == 0


def test_no_upstream_registered(gateway, admin):
    rid = running_rollout(admin)
    response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid))
    assert response.status_code == 503 and "POST /api/models" in response.json()["reason"]


def test_proxy_refuses_unknown_attempt_terminal_rollout_and_bad_endpoint(gateway, admin, registered):
    rid = running_rollout(admin)
    bad_attempt = proxy_url(gateway, rid).replace("/attempt/a1/", "/attempt/a9/")
    assert httpx.post(bad_attempt, json={}, headers=agent_headers(rid)).status_code == 403  # a1's key
    assert admin.post(bad_attempt, json={}).status_code == 404
    assert (
        httpx.post(proxy_url(gateway, rid, endpoint="embeddings"), json={}, headers=agent_headers(rid)).status_code
        == 404
    )
    assert httpx.post(proxy_url(gateway, rid), content=b"[1,2]", headers=agent_headers(rid)).status_code == 400
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "failed", "error_message": "aborted: test"}})
    response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid))
    assert response.status_code == 409 and "failed" in response.json()["reason"]
    assert not registered.behaviour.requests


def test_sticky_upstream_per_rollout(gateway, admin):
    with StubUpstream() as a, StubUpstream() as b:
        admin.post(
            "/api/models",
            json=[{"model": "policy", "endpoint": a.base_url}, {"model": "policy", "endpoint": b.base_url}],
        )
        rids = [running_rollout(admin) for _ in range(12)]
        with httpx.Client(timeout=30) as agents:  # one client: a new one per call costs more than the call
            for rid in rids:
                for _ in range(3):
                    agents.post(proxy_url(gateway, rid), json={"messages": [rid]}, headers=agent_headers(rid))
        for rid in rids:
            upstreams = {e["data"]["upstream"] for e in admin.get(f"/api/rollouts/{rid}/events").json()}
            assert len(upstreams) == 1
        assert a.behaviour.completed and b.behaviour.completed


def test_pause_contract(gateway, admin, registered):
    rid = running_rollout(admin)
    paused = admin.post("/proxy/pause", json={"reason": "weight update", "retry_after_seconds": 7}).json()
    assert paused == {
        "paused": True,
        "retry_after_seconds": 7.0,
        "reason": "weight update",
        "inflight": 0,
        "paused_seconds_total": paused["paused_seconds_total"],
        # Rollover's partial-rollout counts (no engine was frozen, no call spanned a weight load)
        "engine_frozen_seconds_total": 0.0,
        "calls_spanning_update_total": 0,
        "tokens_spanning_update_total": 0,
        "unhonoured_fields_total": {},
    }
    response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid))
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "7" and response.headers["X-Agl-Paused"] == "true"
    assert "retry-after-ms" not in response.headers  # no length announced: the seed's headers only
    assert response.json() == {"error": "gateway paused", "reason": "weight update"}
    assert not registered.behaviour.requests
    admin.post("/proxy/pause", json={})
    assert admin.get("/proxy/state").json()["retry_after_seconds"] == 5.0  # the gateway default
    assert admin.post("/proxy/resume").json()["paused"] is False
    assert admin.post("/proxy/resume").json()["paused"] is False  # idempotent
    assert admin.get("/proxy/state").json()["paused_seconds_total"] > 0
    assert httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid)).status_code == 200


def test_a_pause_of_announced_length_hints_the_time_left(gateway, admin, registered):
    rid = running_rollout(admin)

    def refused_hint() -> tuple[str, int]:
        response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid))
        assert response.status_code == 429
        return response.headers["Retry-After"], int(response.headers["retry-after-ms"])

    admin.post("/proxy/pause", json={"reason": "update", "expected_seconds": 1.2})
    assert refused_hint() == ("5", 5000)  # a short pause: the configured Retry-After, not sooner
    admin.post("/proxy/pause", json={"expected_seconds": 60})
    retry_after, left_ms = refused_hint()
    assert retry_after in ("59", "60") and 58_000 <= left_ms <= 60_000  # when it is expected to end
    assert int(retry_after) * 1000 >= left_ms  # Retry-After rounds up, never earlier than the end
    paused_at = time.monotonic()
    admin.post("/proxy/pause", json={"expected_seconds": 6, "retry_after_seconds": 2})
    time.sleep(0.2)
    retry_after, left_ms = refused_hint()
    elapsed_ms = (time.monotonic() - paused_at) * 1000
    # The time left, counted down from 6 s (however slow the machine), rounded up in both headers.
    assert 6_000 - elapsed_ms - 1 <= left_ms <= 6_000 - 200
    assert int(retry_after) == math.ceil(left_ms / 1000) and int(retry_after) >= 2
    # A pause announced past OpenAI's client limit (it does not retry at all when Retry-After
    # exceeds 120 s) is told in waits of at most 60 s: the client comes back and is told again.
    admin.post("/proxy/pause", json={"expected_seconds": 300})
    assert refused_hint() == ("60", 60_000)
    admin.post("/proxy/resume")
    assert admin.post("/proxy/pause", json={"expected_seconds": -1}).status_code == 422
    admin.post("/proxy/resume")


def test_inflight_calls_finish_while_paused_and_wait_drained_returns_at_zero(gateway, admin, registered):
    registered.behaviour.delay_seconds = 1.0
    rid = running_rollout(admin)
    results = []
    thread = threading.Thread(
        target=lambda: results.append(
            httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid), timeout=30)
        )
    )
    thread.start()
    wait_inflight(admin)
    paused = admin.post("/proxy/pause", json={"reason": "drain"}).json()
    assert paused["inflight"] == 1
    started = time.monotonic()
    drained = admin.get("/proxy/state", params={"wait_drained": 10}).json()
    waited = time.monotonic() - started
    assert drained["inflight"] == 0 and waited < 3
    thread.join()
    assert results[0].status_code == 200  # the in-flight call finished normally
    assert len(admin.get(f"/api/rollouts/{rid}/events").json()) == 1


@pytest.mark.slow
def test_wait_drained_times_out_with_inflight(gateway, admin, registered):
    registered.behaviour.delay_seconds = 6.0  # far longer than the wait, even on a busy machine
    rid = running_rollout(admin)
    thread = threading.Thread(
        target=lambda: httpx.post(
            proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid), timeout=30
        )
    )
    thread.start()
    wait_inflight(admin)
    started = time.monotonic()
    state = admin.get("/proxy/state", params={"wait_drained": 0.5}).json()
    assert state["inflight"] == 1 and time.monotonic() - started >= 0.4  # it waited, then gave up
    thread.join()


def test_agent_disconnect_cancels_upstream_call(gateway, admin, registered):
    registered.behaviour.delay_seconds = 60.0
    rid = running_rollout(admin)
    body = b'{"messages": []}'
    path = proxy_url(gateway, rid).removeprefix(gateway.url)
    headers = "".join(f"{k}: {v}\r\n" for k, v in agent_headers(rid).items())
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {gateway.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body
    with socket.create_connection((gateway.host, gateway.port)) as agent:
        agent.sendall(request)
        deadline = time.monotonic() + 30
        while not registered.behaviour.requests:  # hang up once the upstream is working on it
            assert time.monotonic() < deadline, "the call never reached the upstream"
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while registered.behaviour.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registered.behaviour.cancelled == 1
    assert admin.get("/proxy/state").json()["inflight"] == 0
    assert admin.get(f"/api/rollouts/{rid}/events").json() == []


@pytest.mark.parametrize(
    "endpoint,asked,sent",
    [
        ("chat/completions", {}, {"max_tokens": 256}),  # data.max_response_length's default
        ("chat/completions", {"max_tokens": 10}, {"max_tokens": 10}),  # the agent asks for less
        ("chat/completions", {"max_tokens": 5000}, {"max_tokens": 256}),
        ("chat/completions", {"max_completion_tokens": 4000}, {"max_tokens": 256, "max_completion_tokens": 256}),
        ("chat/completions", {"max_completion_tokens": 12, "max_tokens": 40}, {"max_tokens": 12}),
        ("completions", {"max_tokens": 900}, {"max_tokens": 256}),
    ],
)
def test_generation_is_capped_at_the_response_length(gateway, admin, registered, endpoint, asked, sent):
    rid = running_rollout(admin)
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat/completions" else {"prompt": "hi"}
    response = httpx.post(proxy_url(gateway, rid, endpoint=endpoint), json=body | asked, headers=agent_headers(rid))
    assert response.status_code == 200
    upstream = registered.behaviour.requests[-1]
    assert {key: upstream[key] for key in sent} == sent
