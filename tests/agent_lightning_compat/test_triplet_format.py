"""format=triplet answers as Agent Lightning's does: a call retried with the same prompt is kept
once, its last answer (the peer's `_dedupe_model_requests_by_prompt_token_ids`); Rollover's own
view, format=samples, keeps every call."""

import httpx

from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout


def test_triplet_format_keeps_the_last_call_per_prompt(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running_rollout(admin)
    first = {"messages": [{"role": "user", "content": "2+2?"}]}
    other = {"messages": [{"role": "user", "content": "3+3?"}]}
    for body in (first, other, first):  # the agent retried its first prompt
        assert httpx.post(proxy_url(gateway, rid), json=body, headers=agent_headers(rid)).status_code == 200
    admin.post(f"/api/rollouts/{rid}/attempt/a1/events", json={"event_type": "reward", "data": {"value": 1.0}})
    admin.post(f"/api/rollouts/{rid}/attempt/a1/events", json={"event_type": "note", "data": {}})

    raw = admin.get(f"/api/rollouts/{rid}/events").json()
    calls = [e for e in raw if e["event_type"] == "model_request"]
    assert len(calls) == 3 and calls[0]["data"]["prompt_token_ids"] == calls[2]["data"]["prompt_token_ids"]
    triplet = admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
    assert [e["event_type"] for e in triplet] == ["model_request", "model_request", "reward"]
    assert [e["timestamp"] for e in triplet[:2]] == [calls[1]["timestamp"], calls[2]["timestamp"]]
    assert triplet[0]["data"]["prompt_token_ids"] != triplet[1]["data"]["prompt_token_ids"]
    samples = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()
    assert len(samples["triplets"]) == 3
