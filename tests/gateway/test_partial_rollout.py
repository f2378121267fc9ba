"""Partial rollout, the gateway's side: calls are streamed from the engine, an engine's new
version marks where each call in flight on it changes version, the agent gets the one answer it
asked for, and a frozen engine's time does not count against the upstream timeout."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollover.config import GatewaySettings
from rollover.gateway.server import GatewayThread
from rollover.gateway.streaming import StreamAssembler
from tests.conftest import ADMIN_KEY
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SETTLE_SECONDS = 1.0  # loopback delivers in microseconds: the held stream's chunks are in by then


def partial_gateway(**gateway: Any) -> GatewayThread:
    settings = GatewaySettings.from_config().model_copy(update={"partial_rollout": True})
    return GatewayThread(settings, store=":memory:", admin_key=ADMIN_KEY, **gateway)


@pytest.fixture
def gateway() -> Iterator[GatewayThread]:
    with partial_gateway() as server:
        yield server


def register(admin: httpx.Client, stub: Any, version: int, frozen: bool = False) -> None:
    entry = {"model": "policy", "endpoint": stub.base_url, "policy_version": version, "frozen": frozen}
    assert admin.post("/api/models", json=[entry]).status_code == 201


def recorded(admin: httpx.Client, rid: str) -> list[dict[str, Any]]:
    events = admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    return [e["data"] for e in events]


class Call(threading.Thread):
    """An agent's call on a thread: the answer (or the stream's data lines) when it returns."""

    def __init__(self, url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.headers, self.body = url, headers, body
        self.response: httpx.Response | None = None
        self.lines: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            if self.body.get("stream"):
                with client.stream("POST", self.url, json=self.body, headers=self.headers) as response:
                    self.response = response
                    self.lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            else:
                self.response = client.post(self.url, json=self.body, headers=self.headers)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint,body", [("chat/completions", CHAT), ("completions", {"prompt": "2+2="})])
def test_a_call_across_a_weight_load_is_one_answer_recorded_with_both_versions(
    gateway, admin, stub, endpoint, body, stream
):
    register(admin, stub, 3)
    rid = running_rollout(admin)
    whole = httpx.post(proxy_url(gateway, rid, endpoint=endpoint), json=body, headers=agent_headers(rid)).json()
    stub.behaviour.hold_stream_end = threading.Event()
    call = Call(proxy_url(gateway, rid, endpoint=endpoint), agent_headers(rid), body | {"stream": stream})
    call.start()
    # The engine has sent 3 of its 4 tokens and waits; its weights change (it would be frozen
    # then, and register its new version before going on).
    assert stub.behaviour.holding.wait(30)
    threading.Event().wait(SETTLE_SECONDS)
    register(admin, stub, 4)
    counts = admin.get("/proxy/state").json()
    assert counts["calls_spanning_update_total"] == 1 and counts["tokens_spanning_update_total"] == 3
    stub.behaviour.hold_stream_end.set()
    call.join(30)
    assert call.response is not None and call.response.status_code == 200

    # Streamed from the engine either way; the agent got what it asked for.
    sent = stub.behaviour.requests[-1]
    assert sent["stream"] is True
    if stream:
        assert call.lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: ") :]) for line in call.lines[:-1]]
        ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
        assert ids == whole["choices"][0]["token_ids"]
    else:
        answer = call.response.json()
        assert sent["stream_options"] == {"include_usage": True}
        # One ordinary answer, as the engine gives it unstreamed.
        first = whole["choices"][0]
        choice = answer["choices"][0]
        assert choice["token_ids"] == first["token_ids"] and choice["finish_reason"] == "stop"
        if endpoint == "chat/completions":
            assert choice["message"]["content"] == first["message"]["content"]
            assert answer["object"] == "chat.completion"
        else:
            assert choice["text"] == first["text"]
        assert answer["usage"] == whole["usage"]

    before, spanning = recorded(admin, rid)
    assert before["policy_version"] == 3 and before["response_version_spans"] == [[0, 3]]
    assert spanning["response_token_ids"] == before["response_token_ids"]
    assert spanning["response_logprobs"] == before["response_logprobs"]
    # Tokens 0-2 arrived before the load (version 3), token 3 after it (version 4).
    assert spanning["response_version_spans"] == [[0, 3], [3, 4]]
    assert spanning["policy_version"] == 3  # the oldest token's
    triplet = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"][1]
    assert triplet["response_version_spans"] == [[0, 3], [3, 4]]


def test_each_choice_has_its_own_spans_and_each_engine_its_own_boundary(gateway, admin, stub):
    register(admin, stub, 3)
    other = {"model": "policy", "endpoint": "http://127.0.0.1:9/v1", "policy_version": 3, "live": False}
    admin.post("/api/models", json=[other])
    rid = running_rollout(admin)
    stub.behaviour.hold_stream_end = threading.Event()
    call = Call(proxy_url(gateway, rid), agent_headers(rid), CHAT | {"n": 2})
    call.start()
    assert stub.behaviour.holding.wait(30)
    threading.Event().wait(SETTLE_SECONDS)
    admin.post("/api/models", json=[other | {"policy_version": 9}])  # another engine's load: not this call's
    register(admin, stub, 4)
    stub.behaviour.hold_stream_end.set()
    call.join(30)
    assert call.response is not None and call.response.status_code == 200
    (record,) = recorded(admin, rid)
    assert [c["response_version_spans"] for c in record["choices"]] == [[[0, 3], [3, 4]], [[0, 3], [3, 4]]]
    assert admin.get("/proxy/state").json()["tokens_spanning_update_total"] == 6


@pytest.mark.slow
def test_a_frozen_engines_time_does_not_count_against_the_upstream_timeout(stub):
    timeout = 2.0
    with partial_gateway(upstream_timeout_seconds=timeout, upstream_retries=0) as gateway:
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            register(admin, stub, 3)
            rid = running_rollout(admin)
            stub.behaviour.hold_stream_end = threading.Event()
            # Not frozen: held 3x the upstream timeout, the call times out.
            call = Call(proxy_url(gateway, rid), agent_headers(rid), CHAT)
            call.start()
            call.join(30)
            assert call.response is not None and call.response.status_code == 504, call.response.text
            # Frozen for a weight load (as a frozen engine holds its requests): the wait is not
            # the call's.
            register(admin, stub, 3, frozen=True)
            call = Call(proxy_url(gateway, rid), agent_headers(rid), CHAT)
            call.start()
            threading.Event().wait(3 * timeout)
            register(admin, stub, 4)
            stub.behaviour.hold_stream_end.set()
            call.join(30)
            assert call.response is not None and call.response.status_code == 200, call.response.text
            assert admin.get("/proxy/state").json()["engine_frozen_seconds_total"] >= 3 * timeout


def test_an_engine_removed_while_frozen_leaves_nothing_frozen(gateway, admin, stub):
    register(admin, stub, 3, frozen=True)
    admin.delete("/api/models", params={"endpoint": stub.base_url})
    frozen = admin.get("/proxy/state").json()["engine_frozen_seconds_total"]
    threading.Event().wait(SETTLE_SECONDS)
    assert admin.get("/proxy/state").json()["engine_frozen_seconds_total"] == frozen


def test_drain_mode_calls_are_not_streamed_from_the_engine(stub):
    with GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as drain_gateway:
        with httpx.Client(base_url=drain_gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            register(admin, stub, 3)
            rid = running_rollout(admin)
            assert httpx.post(proxy_url(drain_gateway, rid), json=CHAT, headers=agent_headers(rid)).status_code == 200
            assert stub.behaviour.requests[-1]["stream"] is False
            (record,) = recorded(admin, rid)
            assert "response_version_spans" not in record and record["policy_version"] == 3


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_line_under_way_at_a_weight_load_is_the_old_versions(cut):
    """The stream is cut anywhere in its second line when the load is marked: that line had
    begun to arrive, so it was written before the engine froze."""
    lines = [
        b'data: {"choices": [{"index": 0, "text": "a", "token_ids": [1, 2]}]}\n\n',
        b'data: {"choices": [{"index": 0, "text": "b", "token_ids": [3]}]}\n\n',
        b'data: {"choices": [{"index": 0, "text": "c", "token_ids": [4, 5], "finish_reason": "stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    assembler = StreamAssembler("completions", version=7)
    assembler.feed(lines[0] + lines[1][:cut])
    assembler.mark(8)
    assembler.feed(lines[1][cut:])
    assembler.mark(9)  # a second load while the third line had not begun
    assembler.feed(lines[2] + lines[3])
    assert assembler.response()["choices"][0]["token_ids"] == [1, 2, 3, 4, 5]
    assert assembler.spans == {0: [[0, 7], [3, 9]]}
