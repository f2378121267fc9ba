"""The translated routes (Anthropic Messages, OpenAI Responses) behave as the chat route on what
the chat route guarantees: under partial rollout a call across a weight load is one answer in
the API's shape, recorded with each token's version; with several policies the agent's `model`
picks the policy and the record names it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from tests.conftest import ADMIN_KEY
from tests.gateway.test_partial_rollout import SETTLE_SECONDS, Call, partial_gateway, recorded, register
from tests.gateway.test_proxy import running_rollout

ROUTES = {
    "anthropic": ("anthropic/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("openai/v1/responses", {"input": "hi"}),
}


def route_url(gateway: GatewayThread, rid: str, api: str) -> str:
    return f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/{ROUTES[api][0]}"


def headers(rid: str) -> dict[str, str]:
    return {"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")}


def answer_text(api: str, answer: dict[str, Any]) -> str:
    if api == "anthropic":
        return "".join(block["text"] for block in answer["content"] if block["type"] == "text")
    return "".join(part["text"] for item in answer["output"] for part in item.get("content") or [])


def streamed_text(api: str, lines: list[str]) -> str:
    events = [json.loads(line[len("data: ") :]) for line in lines]
    if api == "anthropic":
        return "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@pytest.fixture
def partial() -> Iterator[GatewayThread]:
    with partial_gateway() as server:
        yield server


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(ROUTES))
def test_a_call_across_a_weight_load_is_one_answer_recorded_with_both_versions(partial, stub, api, stream) -> None:
    with httpx.Client(base_url=partial.url, headers={"x-api-key": ADMIN_KEY}) as admin:
        register(admin, stub, 3)
        rid = running_rollout(admin)
        body = {"model": "policy", **ROUTES[api][1]}
        whole = httpx.post(route_url(partial, rid, api), json=body, headers=headers(rid)).json()
        stub.behaviour.hold_stream_end = threading.Event()
        call = Call(route_url(partial, rid, api), headers(rid), body | {"stream": stream})
        call.start()
        assert stub.behaviour.holding.wait(30)
        threading.Event().wait(SETTLE_SECONDS)
        register(admin, stub, 4)
        stub.behaviour.hold_stream_end.set()
        call.join(30)
        assert call.response is not None and call.response.status_code == 200
        assert stub.behaviour.requests[-1]["stream"] is True  # streamed from the engine either way
        text = streamed_text(api, call.lines) if stream else answer_text(api, call.response.json())
        assert text == answer_text(api, whole)
        before, spanning = recorded(admin, rid)
    assert spanning["api"]["name"] == api
    assert spanning["response_token_ids"] == before["response_token_ids"]
    assert spanning["response_version_spans"] == [[0, 3], [3, 4]] and spanning["policy_version"] == 3


@pytest.mark.parametrize("api", list(ROUTES))
def test_the_agents_model_picks_the_policy(gateway, admin, stub, api) -> None:
    policies = {"planner": "planner-v3", "solver": "solver-v3"}
    entry = {"model": "planner-v3", "endpoint": stub.base_url, "policy_version": 3, "policies": policies}
    admin.post("/api/models", json=[entry]).raise_for_status()
    rid = running_rollout(admin)
    response = httpx.post(
        route_url(gateway, rid, api), json={"model": "solver", **ROUTES[api][1]}, headers=headers(rid)
    )
    assert response.status_code == 200, response.text
    assert stub.behaviour.requests[-1]["model"] == "solver-v3"
    [record] = [e["data"] for e in admin.get(f"/api/rollouts/{rid}/events").json()]
    assert record["policy"] == "solver" and record["model"] == "solver-v3"
    refused = httpx.post(route_url(gateway, rid, api), json={"model": "gpt-4o", **ROUTES[api][1]}, headers=headers(rid))
    assert refused.status_code == 404 and "ask for one of 'planner', 'solver'" in refused.text


@pytest.mark.slow
def test_a_killed_gateway_loses_no_answered_call_of_either_api(tmp_path, stub) -> None:
    """Every call whose answer (whole, or a stream's last event) reached its agent is in the
    store with its token ids after a SIGKILL mid-traffic: recorded before it is answered."""
    from rollover.gateway.server import GatewayProcess

    store = str(tmp_path / "store.db")
    gateway = GatewayProcess(store=store, admin_key=ADMIN_KEY).start()
    with httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}) as admin:
        admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
        rids = [running_rollout(admin) for _ in range(4)]
    answered: dict[str, set[str]] = {rid: set() for rid in rids}
    stop = threading.Event()

    def agent(rid: str, api: str, stream: bool) -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                body = {"model": "policy", **ROUTES[api][1], "stream": stream}
                try:
                    response = client.post(route_url(gateway, rid, api), json=body, headers=headers(rid))
                except httpx.TransportError:
                    return
                if response.status_code != 200:
                    continue
                if stream:
                    last = [line for line in response.text.splitlines() if line.startswith("data: ")][-1]
                    event = json.loads(last[len("data: ") :])
                    if event["type"] not in ("message_stop", "response.completed"):
                        continue  # cut off: not answered
                    if api == "responses":
                        answered[rid].add(event["response"]["id"])
                    else:
                        start = json.loads(response.text.split("data: ", 2)[1].split("\n", 1)[0])
                        answered[rid].add(start["message"]["id"])
                else:
                    answered[rid].add(response.json()["id"])

    threads = [
        threading.Thread(target=agent, args=(rid, api, stream))
        for rid, (api, stream) in zip(
            rids, [("anthropic", False), ("anthropic", True), ("responses", False), ("responses", True)]
        )
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while sum(map(len, answered.values())) < 40 and time.monotonic() < deadline:  # traffic in full swing
        time.sleep(0.05)
    gateway.kill()
    stop.set()
    for thread in threads:
        thread.join()
    assert all(answered.values()), answered
    restarted = GatewayProcess(store=store, admin_key=ADMIN_KEY, port=gateway.port).start()
    try:
        with httpx.Client(base_url=restarted.url, headers={"x-api-key": ADMIN_KEY}) as admin:
            for rid, ids in answered.items():
                records = recorded(admin, rid)
                kept = {r["api"]["id"] for r in records if r.get("response_token_ids")}
                assert ids <= kept, (rid, ids - kept)
    finally:
        restarted.stop()


@pytest.mark.parametrize("api", list(ROUTES))
def test_a_body_over_the_limit_is_refused_in_the_apis_shape_before_it_is_parsed(stub, api) -> None:
    with GatewayThread(store=":memory:", admin_key=ADMIN_KEY, max_body_bytes=1000) as small:
        with httpx.Client(base_url=small.url, headers={"x-api-key": ADMIN_KEY}) as admin:
            rid = running_rollout(admin)
        body = {"model": "policy", **ROUTES[api][1], "padding": "x" * 2000}
        response = httpx.post(route_url(small, rid, api), json=body, headers=headers(rid))
    assert response.status_code == 413
    error = response.json()
    message = error["error"]["message"]
    assert "gateway.max_body_bytes" in message
    assert (error["type"] == "error") if api == "anthropic" else ("type" in error["error"])


@pytest.mark.parametrize(
    "api, extra",
    [
        ("anthropic", {"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
        ("responses", {"tool_choice": "required", "tools": [{"type": "function", "name": "f"}]}),
    ],
)
def test_a_forced_tool_choice_is_refused_in_train_mode_and_served_in_val(gateway, admin, stub, api, extra) -> None:
    """A forced tool choice is guided decoding: in train mode the recorded logprobs would not be
    the policy's (the chat route's rule, `gateway.sampling`), so it is refused in the API's shape."""
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    rid = running_rollout(admin)
    body = {"model": "policy", **ROUTES[api][1], **extra}
    refused = httpx.post(route_url(gateway, rid, api), json=body, headers=headers(rid))
    assert refused.status_code == 400 and "tool_choice" in refused.text
    assert stub.behaviour.requests == []
    val = running_rollout(admin, is_train=False)
    url = route_url(gateway, val, api).replace("/mode/train/", "/mode/val/")
    assert httpx.post(url, json=body, headers=headers(val)).status_code == 200
