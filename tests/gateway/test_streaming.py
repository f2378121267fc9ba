"""`stream: true` calls: the engine's chunks reach the agent as they are made, and the call is
recorded once, with token ids and logprobs, like an unstreamed one."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout, wait_inflight

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def registered(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 3}])
    return stub


def data_lines(lines):
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def model_requests(admin, rid):
    return admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()


@pytest.mark.parametrize("endpoint,body", [("chat/completions", CHAT), ("completions", {"prompt": "2+2="})])
def test_chunks_are_relayed_as_they_arrive_and_the_call_recorded_once(gateway, admin, registered, endpoint, body):
    rid = running_rollout(admin)
    unstreamed = httpx.post(proxy_url(gateway, rid, endpoint=endpoint), json=body, headers=agent_headers(rid)).json()
    registered.behaviour.hold_stream_end = threading.Event()
    chunks = []
    with httpx.stream(
        "POST",
        proxy_url(gateway, rid, endpoint=endpoint),
        json=body | {"stream": True},
        headers=agent_headers(rid),
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = data_lines(response.iter_lines())
        while len([c for c in chunks if c["choices"][0].get("token_ids")]) < 3:
            chunks.append(json.loads(next(lines)))
        # The engine has not finished: the agent already has three tokens, nothing is recorded
        # yet and the call is in flight (a drain would wait for it).
        assert registered.behaviour.completed == 1  # the unstreamed call only
        assert len(model_requests(admin, rid)) == 1
        assert admin.get("/proxy/state").json()["inflight"] == 1
        registered.behaviour.hold_stream_end.set()
        rest = list(lines)
    assert rest[-1] == "[DONE]"
    chunks += [json.loads(line) for line in rest[:-1]]
    sent = registered.behaviour.requests[-1]
    assert sent["stream"] is True and sent["return_token_ids"] is True and "logprobs" in sent

    choice = unstreamed["choices"][0]
    pieces = [c["choices"][0]["delta" if endpoint == "chat/completions" else "text"] for c in chunks]
    text = "".join(p.get("content") or "" for p in pieces) if endpoint == "chat/completions" else "".join(pieces)
    assert text == (choice["message"]["content"] if endpoint == "chat/completions" else choice["text"])
    streamed_ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert streamed_ids == choice["token_ids"]

    # Counted out once the last chunk is sent, which may be just after the agent has it.
    assert admin.get("/proxy/state", params={"wait_drained": 10}).json()["inflight"] == 0
    first, streamed = model_requests(admin, rid)
    data = streamed["data"]
    assert data["request"]["stream"] is True and data["policy_version"] == 3
    for key in ("prompt_token_ids", "response_token_ids", "response_logprobs"):
        assert data[key] == first["data"][key], key
    assert data["response_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    if endpoint == "chat/completions":
        assert data["response"]["choices"][0]["message"] == {"role": "assistant", "content": text}
    else:
        assert data["response"]["choices"][0]["text"] == text
    [_, triplet] = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"]
    assert triplet["response_token_ids"] == choice["token_ids"]


def test_an_openai_client_streams_through_the_proxy(gateway, admin, registered):
    rid = running_rollout(admin)
    base_url = proxy_url(gateway, rid).removesuffix("/chat/completions")
    client = openai.OpenAI(base_url=base_url, api_key=agent_headers(rid)["Authorization"][7:], max_retries=0)
    stream = client.chat.completions.create(model="m", stream=True, stream_options={"include_usage": True}, **CHAT)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("echo ") and chunks[-1].usage.completion_tokens == 4
    [event] = model_requests(admin, rid)
    assert event["data"]["response"]["choices"][0]["message"]["content"] == text
    assert event["data"]["response"]["usage"]["completion_tokens"] == 4
    assert len(event["data"]["response_token_ids"]) == 4


def test_an_agent_hanging_up_mid_stream_stops_the_engine_and_records_nothing(gateway, admin, registered):
    registered.behaviour.hold_stream_end = threading.Event()
    rid = running_rollout(admin)
    body = json.dumps(CHAT | {"stream": True}).encode()
    path = proxy_url(gateway, rid).removeprefix(gateway.url)
    headers = "".join(f"{k}: {v}\r\n" for k, v in agent_headers(rid).items())
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {gateway.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body
    with socket.create_connection((gateway.host, gateway.port)) as agent:
        agent.sendall(request)
        agent.settimeout(30)
        received = b""
        while b'"token_ids"' not in received:  # the stream has started reaching the agent
            received += agent.recv(65536)
        wait_inflight(admin)
    deadline = time.monotonic() + 30
    while registered.behaviour.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registered.behaviour.cancelled == 1 and registered.behaviour.completed == 0
    assert admin.get("/proxy/state", params={"wait_drained": 10}).json()["inflight"] == 0
    assert model_requests(admin, rid) == []
    registered.behaviour.hold_stream_end.set()
