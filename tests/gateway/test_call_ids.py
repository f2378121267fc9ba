"""Every recorded call has a `call_id` the agent can name (a reward for that turn names it): in
the `X-Agl-Call-Id` header and in the answer's `id`, whole or streamed, on every route."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout
from tests.gateway.test_translated_routes import ROUTES, route_url


@pytest.fixture
def registered(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    return stub


def first_id(lines: list[str]) -> str:
    event = json.loads(lines[0][len("data: ") :])
    return str(event.get("id") or (event.get("message") or event.get("response") or {}).get("id"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "completions", *ROUTES])
def test_the_call_id_is_in_the_header_the_body_and_the_record(gateway, admin, registered, api, stream) -> None:
    rid = running_rollout(admin)
    if api in ROUTES:
        url, body = route_url(gateway, rid, api), {"model": "policy", **ROUTES[api][1]}
    elif api == "chat":
        url, body = proxy_url(gateway, rid), {"messages": [{"role": "user", "content": "hi"}]}
    else:
        url, body = proxy_url(gateway, rid, endpoint="completions"), {"prompt": "2+2="}
    response = httpx.post(url, json=body | {"stream": stream}, headers=agent_headers(rid))
    assert response.status_code == 200, response.text
    call_id = response.headers["x-agl-call-id"]
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    body_id = first_id(lines) if stream else response.json()["id"]
    assert body_id == {"chat": f"chatcmpl-{call_id}", "completions": f"cmpl-{call_id}"}.get(api, call_id)
    [record] = [e["data"] for e in admin.get(f"/api/rollouts/{rid}/events").json()]
    assert record["call_id"] == call_id
    # Each call its own.
    again = httpx.post(url, json=body, headers=agent_headers(rid))
    assert again.headers["x-agl-call-id"] != call_id
