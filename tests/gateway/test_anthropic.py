"""Anthropic's Messages API through the recording proxy, driven by the real Anthropic SDK against
the stand-in engine: the answer's shape, streamed and not, a tool round trip, the record, pause
and keys, and refusals in Anthropic's error shape."""

from __future__ import annotations

import threading
from typing import Any

import anthropic
import httpx
import pytest

from rollover.gateway.keys import scoped_key
from tests.conftest import ADMIN_KEY
from tests.gateway.test_proxy import running_rollout, wait_inflight

TOOL = {
    "name": "search",
    "description": "Look something up.",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}


@pytest.fixture
def registered(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 3}])
    return stub


def base_url(gateway, rollout_id, mode="train"):
    return f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/a1/mode/{mode}/anthropic"


def client_for(gateway, rollout_id, **options: Any) -> anthropic.Anthropic:
    key = scoped_key(ADMIN_KEY, rollout_id, "a1")
    return anthropic.Anthropic(base_url=base_url(gateway, rollout_id), api_key=key, **options)


def model_requests(admin, rollout_id):
    return [
        e["data"]
        for e in admin.get(f"/api/rollouts/{rollout_id}/events", params={"event_type": "model_request"}).json()
    ]


def test_a_text_answer_has_anthropics_shape_and_is_recorded_as_a_chat_call(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    client = client_for(gateway, rid)
    message = client.messages.create(
        model="policy",
        max_tokens=64,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": "u1"},
        stop_sequences=["###"],
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "policy"
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text.startswith("echo ")
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 8 and message.usage.output_tokens == 4
    # The engine got a chat request with the system turn, the stop sequences and the cap.
    sent = registered.behaviour.requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert sent["stop"] == ["###"] and sent["max_tokens"] == 64 and sent["logprobs"] is True
    assert "metadata" not in sent and sent["return_token_ids"] is True
    [record] = model_requests(admin, rid)
    assert record["endpoint"] == "chat/completions" and record["api"] == {"name": "anthropic", "id": message.id}
    assert record["policy_version"] == 3
    assert record["response_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert len(record["prompt_token_ids"]) == 8 and len(record["response_token_ids"]) == 4
    # What the engine cannot honour is counted, never passed on.
    unhonoured = admin.get("/proxy/state").json()["unhonoured_fields_total"]
    assert unhonoured == {"anthropic.cache_control": 1, "anthropic.metadata": 1}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_round_trip(gateway, admin, registered, stream: bool) -> None:
    rid = running_rollout(admin)
    client = client_for(gateway, rid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find x"}]
    if stream:
        with client.messages.stream(model="policy", max_tokens=64, messages=messages, tools=[TOOL]) as events:
            kinds = [event.type for event in events]
            first = events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    else:
        first = client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[TOOL])
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.name == "search" and call.input == {"query": call.input["query"]}
    sent = registered.behaviour.requests[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {"name": "search", "description": TOOL["description"], "parameters": TOOL["input_schema"]},
        }
    ]
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "x = 4"}]},
    ]
    second = client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[TOOL], stream=False)
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    sent = registered.behaviour.requests[-1]
    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "search", "arguments": _json(call.input)}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "x = 4"},
    ]
    records = model_requests(admin, rid)
    assert [r["api"]["id"] for r in records] == [first.id, second.id]
    assert all(len(r["response_token_ids"]) == 4 and r["response_logprobs"] for r in records)


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


def test_a_system_message_among_the_messages_stays_where_it_is(gateway, admin, registered) -> None:
    """Claude Code (2.1.3xx) sends its environment (working directory, platform, ...) as a
    `system` message after the user's first turn, not in `system`: it reaches the engine as a
    system message at that place."""
    rid = running_rollout(admin)
    environment = "# Environment\n - Primary working directory: /tmp/w"
    message = client_for(gateway, rid).messages.create(
        model="policy",
        max_tokens=64,
        system="Be brief.",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "read notes.txt"}]},
            {"role": "system", "content": environment},  # type: ignore[list-item, misc]
        ],
    )
    assert message.stop_reason == "end_turn"
    assert registered.behaviour.requests[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "read notes.txt"},
        {"role": "system", "content": environment},
    ]


def test_count_tokens_asks_the_engine_to_render_the_messages(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    count = client_for(gateway, rid).messages.count_tokens(
        model="policy", messages=[{"role": "user", "content": "hi"}], tools=[TOOL]
    )
    assert count.input_tokens == 8
    sent = registered.behaviour.requests[-1]
    assert sent["add_generation_prompt"] is True and sent["tools"][0]["function"]["name"] == "search"
    assert model_requests(admin, rid) == []  # counting generates nothing and records nothing


def test_a_paused_gateway_answers_429_with_retry_after_which_the_sdk_waits_out(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    admin.post("/proxy/pause", json={"reason": "update", "retry_after_seconds": 1})
    refused = httpx.post(
        base_url(gateway, rid) + "/v1/messages",
        json={"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")},
    )
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "gateway paused: update"},
    }
    # The SDK's own retry waits for the Retry-After and gets through once the gateway resumes.
    threading.Timer(1.5, lambda: admin.post("/proxy/resume")).start()
    message = client_for(gateway, rid, max_retries=5).messages.create(
        model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].type == "text"
    assert len(model_requests(admin, rid)) == 1


def test_a_call_in_flight_holds_the_drain(gateway, admin, registered) -> None:
    registered.behaviour.delay_seconds = 1.0
    rid = running_rollout(admin)
    done: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: done.update(
            m=client_for(gateway, rid).messages.create(
                model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        )
    )
    worker.start()
    wait_inflight(admin)
    admin.post("/proxy/pause", json={"reason": "drain"})
    drained = admin.get("/proxy/state", params={"wait_drained": 30}).json()
    assert drained["inflight"] == 0
    worker.join()
    # The call was answered, not refused: the drain waited for it (its answer may still have
    # been on its way to the client when the drain returned, so this is checked after the join).
    assert "m" in done
    assert len(model_requests(admin, rid)) == 1


@pytest.mark.parametrize(
    "headers, status, kind",
    [
        ({}, 401, "authentication_error"),
        ({"x-api-key": "rk-0000"}, 403, "permission_error"),
        ({"x-api-key": ADMIN_KEY}, 200, None),
    ],
)
def test_keys(gateway, admin, registered, headers: dict[str, str], status: int, kind: str | None) -> None:
    rid = running_rollout(admin)
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(base_url(gateway, rid) + "/v1/messages?beta=true", json=body, headers=headers)
    assert response.status_code == status, response.text
    if kind is not None:
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind


def test_bearer_auth_works_too(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}", "anthropic-beta": "x-2025"}
    response = httpx.post(base_url(gateway, rid) + "/v1/messages", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert admin.get("/proxy/state").json()["unhonoured_fields_total"] == {"anthropic.anthropic-beta": 1}


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "p", "max_tokens": "8", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"model": "p", "max_tokens": 8, "messages": []}, "messages"),
        ({"model": "p", "max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
        (
            {
                "model": "p",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}],
            },
            "no earlier tool_use",
        ),
        (
            {
                "model": "p",
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ],
            },
            "takes no images",
        ),
        (
            {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]},
            "tools.0",
        ),
    ],
)
def test_malformed_bodies_get_400_in_anthropics_shape_and_change_nothing(
    gateway, admin, registered, body: dict[str, Any], fragment: str
) -> None:
    rid = running_rollout(admin)
    sent_before = len(registered.behaviour.requests)
    response = httpx.post(
        base_url(gateway, rid) + "/v1/messages", json=body, headers={"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")}
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]
    assert len(registered.behaviour.requests) == sent_before
    assert admin.get(f"/api/rollouts/{rid}/events").json() == []


def test_an_engine_error_comes_back_in_anthropics_shape(gateway, admin, registered) -> None:
    registered.behaviour.fail_next = 10
    rid = running_rollout(admin)
    client = client_for(gateway, rid, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as failed:
        client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 502 and "injected failure" in str(failed.value)
