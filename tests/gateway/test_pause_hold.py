"""gateway.hold_while_paused: calls that arrive during a pause wait for the resume instead of a 429."""

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from rollover.gateway.server import GatewayThread
from tests.conftest import ADMIN_KEY
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout

PAUSE_SECONDS = 4.0  # the client's retries below last about 2 x 0.5 s: a 4x margin


@pytest.fixture
def gateway(request) -> Iterator[GatewayThread]:
    hold = request.param if hasattr(request, "param") else {}
    with GatewayThread(store=":memory:", admin_key=ADMIN_KEY, retry_after_seconds=0.5, **hold) as server:
        yield server


def impatient_client(gateway, rid) -> openai.OpenAI:
    base_url = proxy_url(gateway, rid).removesuffix("/chat/completions")
    return openai.OpenAI(base_url=base_url, api_key=agent_headers(rid)["Authorization"][7:], max_retries=2, timeout=60)


def resume_later(admin, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: admin.post("/proxy/resume"))
    timer.start()
    return timer


@pytest.mark.slow
@pytest.mark.parametrize("gateway", [{"hold_while_paused": True}], indirect=True)
def test_a_held_call_outlives_the_clients_retries_and_is_forwarded_at_resume(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running_rollout(admin)
    admin.post("/proxy/pause", json={"reason": "update"})
    timer = resume_later(admin, PAUSE_SECONDS)
    started = time.monotonic()
    result: list = []
    call = threading.Thread(
        target=lambda: result.append(
            impatient_client(gateway, rid).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        )
    )
    call.start()
    time.sleep(0.5)
    # Held, not in flight: a drain during the pause does not wait for it.
    drained = admin.get("/proxy/state", params={"wait_drained": 2}).json()
    assert drained["paused"] is True and drained["inflight"] == 0
    assert not stub.behaviour.requests
    call.join(timeout=30)
    timer.join()
    assert result and result[0].choices[0].message.content.startswith("echo")
    assert time.monotonic() - started >= PAUSE_SECONDS * 0.9
    assert len(stub.behaviour.requests) == 1  # forwarded once, at resume
    assert len(admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()) == 1


def test_by_default_the_same_client_gets_the_seeds_429(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running_rollout(admin)
    admin.post("/proxy/pause", json={"reason": "update"})
    timer = resume_later(admin, PAUSE_SECONDS)
    with pytest.raises(openai.RateLimitError):
        impatient_client(gateway, rid).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    timer.cancel()
    admin.post("/proxy/resume")
    assert not stub.behaviour.requests


@pytest.mark.parametrize("gateway", [{"hold_while_paused": True, "max_hold_seconds": 1}], indirect=True)
def test_a_call_held_longer_than_the_maximum_gets_the_seeds_429(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running_rollout(admin)
    admin.post("/proxy/pause", json={"reason": "long update"})
    started = time.monotonic()
    response = httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid), timeout=30)
    assert response.status_code == 429 and time.monotonic() - started >= 1.0
    assert response.headers["Retry-After"] == "0.5" and response.headers["X-Agl-Paused"] == "true"
    assert response.json() == {"error": "gateway paused", "reason": "long update"}
    admin.post("/proxy/resume")
    assert httpx.post(proxy_url(gateway, rid), json={"messages": []}, headers=agent_headers(rid)).status_code == 200
