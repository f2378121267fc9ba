"""Nothing an agent can read names an engine's address: its rollout's records, the proxy's
error reasons, the models it is told about. The admin key still reads the whole record."""

from __future__ import annotations

import httpx

from rollover.processes import free_port
from tests.conftest import ADMIN_KEY
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def test_an_agent_never_reads_an_engine_address(gateway, admin, stub) -> None:
    engine = stub.base_url
    port = str(stub.port)
    admin.post("/api/models", json=[{"model": "policy", "endpoint": engine}])
    rid = running_rollout(admin)
    headers = agent_headers(rid)
    assert httpx.post(proxy_url(gateway, rid), json=CHAT, headers=headers).status_code == 200
    events_url = f"{gateway.url}/api/rollouts/{rid}/events"
    for params in ({}, {"format": "triplet"}, {"format": "samples"}, {"event_type": "model_request"}):
        seen = httpx.get(events_url, params=params, headers=headers)
        assert seen.status_code == 200 and port not in seen.text, (params, seen.text[:500])
    models = httpx.get(proxy_url(gateway, rid, endpoint="models"), headers=headers)
    assert models.status_code == 200 and port not in models.text
    # The admin reads which engine served the call.
    [record] = httpx.get(events_url, params={"event_type": "model_request"}, headers={"x-api-key": ADMIN_KEY}).json()
    assert record["data"]["upstream"] == engine


def test_an_unreachable_engine_is_not_named_in_the_reason(gateway, admin) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    admin.post("/api/models", json=[{"model": "policy", "endpoint": dead}])
    rid = running_rollout(admin)
    refused = httpx.post(proxy_url(gateway, rid), json=CHAT, headers=agent_headers(rid), timeout=60)
    assert refused.status_code == 503 and set(refused.json()) == {"error", "reason"}
    assert dead.split("//")[1].split("/")[0] not in refused.text and "127.0.0.1" not in refused.text
