"""OpenAI's Responses API through the recording proxy, driven by the real OpenAI SDK
(`responses.create`) against the stand-in engine: the answer's shape, streamed and not, a
function tool round trip, `previous_response_id` (kept in the store, also across a gateway
restart) and `store: false`, pause and keys, and refusals in OpenAI's error shape."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from tests.conftest import ADMIN_KEY
from tests.gateway.test_anthropic import model_requests
from tests.gateway.test_proxy import running_rollout

TOOL = {
    "type": "function",
    "name": "search",
    "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}


@pytest.fixture
def registered(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 5}])
    return stub


def base_url(gateway, rollout_id, attempt_id="a1"):
    return f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/train/openai/v1"


def client_for(gateway, rollout_id, attempt_id="a1", **options: Any) -> openai.OpenAI:
    key = scoped_key(ADMIN_KEY, rollout_id, attempt_id)
    return openai.OpenAI(base_url=base_url(gateway, rollout_id, attempt_id), api_key=key, **options)


def test_a_text_answer_has_the_apis_shape_and_is_recorded(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    response = client_for(gateway, rid).responses.create(
        model="policy", instructions="Be brief.", input="hi", max_output_tokens=32, reasoning={"effort": "low"}
    )
    assert response.id.startswith("resp_") and response.status == "completed" and response.model == "policy"
    assert response.output_text.startswith("echo ")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (8, 4)
    sent = registered.behaviour.requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert sent["max_tokens"] == 32 and "reasoning" not in sent
    [record] = model_requests(admin, rid)
    assert record["api"] == {"name": "responses", "id": response.id, "store": True, "instructions": True}
    assert record["policy_version"] == 5 and len(record["response_token_ids"]) == 4 and record["response_logprobs"]
    assert admin.get("/proxy/state").json()["unhonoured_fields_total"] == {"responses.reasoning": 1}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_function_tool_round_trip_with_the_whole_context(gateway, admin, registered, stream: bool) -> None:
    rid = running_rollout(admin)
    client = client_for(gateway, rid)
    items: list[Any] = [{"role": "user", "content": "find x"}]
    if stream:
        events = list(client.responses.create(model="policy", input=items, tools=[TOOL], stream=True, store=False))
        kinds = [event.type for event in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        first = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == first.output[0].arguments
    else:
        first = client.responses.create(model="policy", input=items, tools=[TOOL], store=False)
    [call] = first.output
    assert call.type == "function_call" and call.name == "search" and call.status == "completed"
    sent = registered.behaviour.requests[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {"name": "search", "description": TOOL["description"], "parameters": TOOL["parameters"]},
        }
    ]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "x = 4"})
    second = client.responses.create(model="policy", input=items, tools=[TOOL], store=False)
    assert second.output[0].type == "message"
    sent = registered.behaviour.requests[-1]
    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "search", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "x = 4"},
    ]
    assert len(model_requests(admin, rid)) == 2


def test_previous_response_id_continues_from_the_store(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    client = client_for(gateway, rid)
    first = client.responses.create(model="policy", instructions="Old rules.", input="find x", tools=[TOOL])
    [call] = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "x = 4"}
    second = client.responses.create(
        model="policy", instructions="New rules.", previous_response_id=first.id, input=[output], tools=[TOOL]
    )
    assert second.previous_response_id == first.id
    context = registered.behaviour.requests[-1]["messages"]
    # The earlier call's context and answer, without its instructions (they are not inherited).
    assert context == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "find x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "search", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "x = 4"},
    ]


def test_a_restarted_gateway_finds_earlier_responses_in_the_store(tmp_path, stub) -> None:
    store = str(tmp_path / "store.db")
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as gateway:
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 0}])
            rid = running_rollout(admin)
        first = client_for(gateway, rid).responses.create(model="policy", input="find x")
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as gateway:
        second = client_for(gateway, rid).responses.create(
            model="policy", input="and y?", previous_response_id=first.id
        )
    assert second.status == "completed"
    assert stub.behaviour.requests[-1]["messages"] == [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and y?"},
    ]


def test_previous_response_id_refusals(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    client = client_for(gateway, rid)
    kept = client.responses.create(model="policy", input="hi")
    unkept = client.responses.create(model="policy", input="hi", store=False)
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.create(model="policy", input="more", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError, match="store: false"):
        client.responses.create(model="policy", input="more", previous_response_id=unkept.id)
    # Another rollout's response is not found here; another attempt's is refused.
    other = running_rollout(admin)
    with pytest.raises(openai.NotFoundError):
        client_for(gateway, other).responses.create(model="policy", input="more", previous_response_id=kept.id)
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "queuing"}})
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a2"}})
    with pytest.raises(openai.PermissionDeniedError, match="belongs to attempt a1"):
        client_for(gateway, rid, "a2").responses.create(model="policy", input="more", previous_response_id=kept.id)
    assert len(model_requests(admin, rid)) == 2


def test_a_paused_gateway_answers_429_which_the_sdk_waits_out(gateway, admin, registered) -> None:
    rid = running_rollout(admin)
    admin.post("/proxy/pause", json={"reason": "update", "retry_after_seconds": 1})
    refused = httpx.post(
        base_url(gateway, rid) + "/responses",
        json={"model": "policy", "input": "hi"},
        headers={"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"},
    )
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    threading.Timer(1.5, lambda: admin.post("/proxy/resume")).start()
    response = client_for(gateway, rid, max_retries=5).responses.create(model="policy", input="hi")
    assert response.status == "completed"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input": "hi"}, "model"),
        ({"model": "p", "input": 3}, "input"),
        ({"model": "p", "input": [{"type": "computer_call", "id": "x"}]}, "computer_call"),
        (
            {
                "model": "p",
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
                ],
            },
            "takes no images",
        ),
        ({"model": "p", "input": "hi", "tools": [{"type": "function"}]}, "tools.0.name"),
        ({"model": "p", "input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"model": "p", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_malformed_bodies_get_400_in_openais_shape_and_change_nothing(
    gateway, admin, registered, body: dict[str, Any], fragment: str
) -> None:
    rid = running_rollout(admin)
    sent_before = len(registered.behaviour.requests)
    response = httpx.post(
        base_url(gateway, rid) + "/responses",
        json=body,
        headers={"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    assert len(registered.behaviour.requests) == sent_before
    assert admin.get(f"/api/rollouts/{rid}/events").json() == []
