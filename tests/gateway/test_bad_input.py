"""Input that once broke the gateway (issue 12, "Bad input"): each is a 4xx JSON
`{"error", "reason"}` and leaves the store as it was, or is stored and served back intact."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from tests.conftest import ADMIN_KEY


def running(admin: httpx.Client) -> str:
    rid = admin.post("/api/rollouts", json=[{"input": {"q": 1}}]).json()[0]["rollout_id"]
    running = {"status": {"state": "running", "last_attempt_id": "a1"}}
    assert admin.patch(f"/api/rollouts/{rid}", json=running).status_code == 200
    return rid


def store_dump(admin: httpx.Client) -> tuple[object, ...]:
    """Everything the store answers: rollouts and every rollout's events."""
    rollouts = admin.get("/api/rollouts").json()
    events = [admin.get(f"/api/rollouts/{r['rollout_id']}/events").json() for r in rollouts]
    return rollouts, events


def assert_refused(response: httpx.Response, status: int | None = None) -> dict[str, str]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["error"] and body["reason"]
    return body


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def proxy_path(rid: str) -> str:
    return f"/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions"


@pytest.mark.parametrize("depth", [65, 200, 1000, 2000])
def test_deep_json_is_refused_everywhere_and_nothing_is_stored(admin, stub, depth):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running(admin)
    before = store_dump(admin)
    bodies = {
        f"/api/rollouts/{rid}/attempt/a1/events": b'{"event_type": "note", "data": ' + nested(depth) + b"}",
        "/api/rollouts": b'[{"input": 1, "metadata": {"deep": ' + nested(depth) + b"}}]",
        proxy_path(rid): b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + nested(depth) + b"}",
    }
    for path, body in bodies.items():
        reason = assert_refused(admin.post(path, content=body), 400)["reason"]
        assert "64 levels" in reason and "gateway.max_json_depth" in reason
    assert store_dump(admin) == before
    assert not stub.behaviour.requests  # the proxy refused before calling the engine


def test_json_at_the_depth_limit_is_stored_and_served_back(admin):
    rid = running(admin)
    data = json.loads(nested(63))  # the event body wraps it: 64 levels in all
    posted = admin.post(f"/api/rollouts/{rid}/attempt/a1/events", json={"event_type": "note", "data": data})
    assert posted.status_code == 201, posted.text
    assert admin.get(f"/api/rollouts/{rid}/events").json()[0]["data"] == data
    assert admin.get("/api/rollouts").status_code == 200


@pytest.mark.parametrize("text", [rb'"\ud800"', rb'"\udfff x"', b'"\xed\xa0\x80"'])
def test_lone_surrogates_are_refused_and_nothing_is_stored(admin, stub, text):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    rid = running(admin)
    before = store_dump(admin)
    for path, body in {
        "/api/rollouts": b'[{"input": ' + text + b"}]",
        f"/api/rollouts/{rid}/attempt/a1/events": b'{"event_type": "note", "data": {"s": ' + text + b"}}",
        proxy_path(rid): b'{"messages": [{"role": "user", "content": ' + text + b"}]}",
    }.items():
        assert_refused(admin.post(path, content=body), 400)
    assert store_dump(admin) == before
    assert admin.get("/api/rollouts").status_code == 200
    assert not stub.behaviour.requests


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b'"1.0"', b"true", b"null"])
def test_bad_rewards_are_refused_and_the_earlier_reward_stands(admin, value):
    rid = running(admin)
    url = f"/api/rollouts/{rid}/attempt/a1/events"
    assert admin.post(url, json={"event_type": "reward", "data": {"value": 0.75}}).status_code == 201
    before = store_dump(admin)
    status = 400 if value in (b"NaN", b"Infinity", b"-Infinity", b"1e999") else 422  # not JSON / not a number
    assert_refused(admin.post(url, content=b'{"event_type": "reward", "data": {"value": ' + value + b"}}"), status)
    assert_refused(admin.post(url, json={"event_type": "reward", "data": 1.0}), 422)  # not {"value": ...}
    assert store_dump(admin) == before
    assert admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["reward"] == 0.75


@pytest.mark.parametrize("final", ["succeeded", "failed"])
def test_events_to_a_finished_rollout_are_409_with_any_key(gateway, admin, final):
    rid = running(admin)
    assert admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": final}}).status_code == 200
    before = store_dump(admin)
    reward = {"event_type": "reward", "data": {"value": 1.0}}
    url = f"/api/rollouts/{rid}/attempt/a1/events"
    assert assert_refused(admin.post(url, json=reward), 409)["error"] == "conflict"
    agent = {"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")}
    assert_refused(httpx.post(gateway.url + url, json=reward, headers=agent), 409)
    assert_refused(httpx.post(gateway.url + proxy_path(rid), json={"messages": []}, headers=agent), 409)
    assert store_dump(admin) == before


def test_router_404_and_405_answer_the_gateways_shape(admin):
    missing = assert_refused(admin.get("/api/nothing-here"), 404)
    assert missing == {"error": "not found", "reason": "no endpoint GET /api/nothing-here"}
    wrong = assert_refused(admin.put("/api/rollouts"), 405)
    assert wrong["error"] == "method not allowed" and "PUT /api/rollouts" in wrong["reason"]


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/api/rollouts?limit=abc"),
        ("GET", "/api/rollouts?state_in=sleeping"),
        ("GET", "/proxy/state?wait_drained=-1"),
        ("GET", "/api/rollouts/r1/events?format=csv"),
        ("GET", "/proxy/rollout/r1/attempt/a1/mode/test/openai/v1/models"),
    ],
)
def test_a_request_without_a_key_is_401_before_its_query_is_checked(gateway, admin, method, path):
    assert_refused(httpx.request(method, gateway.url + path), 401)
    assert admin.request(method, path).status_code in (404, 422)  # with the key: the query's own answer


class _NaNUpstream(BaseHTTPRequestHandler):
    """An engine answering 200 with a NaN logprob, as Python's json module writes it."""

    calls = 0
    body = json.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "model": "policy",
            "prompt_token_ids": [1, 2],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                    "token_ids": [5, 6],
                    "logprobs": {"content": [{"token": "a", "logprob": float("nan")}, {"token": "b", "logprob": -0.5}]},
                }
            ],
        }
    ).encode()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def nan_upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NaNUpstream)
    _NaNUpstream.calls = 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_an_upstream_nan_logprob_is_recorded_once_as_null_and_answered_200(gateway, admin, nan_upstream):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": nan_upstream}])
    rid = running(admin)
    agent = {"x-api-key": scoped_key(ADMIN_KEY, rid, "a1")}
    response = httpx.post(gateway.url + proxy_path(rid), json={"messages": [], "stream": False}, headers=agent)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["content"][0]["logprob"] is None  # standard JSON
    assert _NaNUpstream.calls == 1
    [event] = admin.get(f"/api/rollouts/{rid}/events").json()
    assert event["data"]["response_token_ids"] == [5, 6]
    assert event["data"]["response_logprobs"] is None  # not behaviour logprobs: recorded as missing
    [call] = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"]
    assert call["response_logprobs"] is None and call["response_token_ids"] == [5, 6]
    assert admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).status_code == 200


# -- integers out of range: every integer the API takes is bounded (SQLite's are 64-bit) ----

BIG = 2**64  # past SQLite's INTEGER: was a 500 (OverflowError) where it reached a query
INT64 = 2**63 - 1
ENGINE = {"model": "m", "endpoint": "http://e/v1"}


@pytest.mark.parametrize(
    "method,path,body,parameter",
    [
        ("GET", f"/api/rollouts/terminal?after={BIG}", None, "after"),
        ("GET", f"/api/rollouts/terminal?after={INT64 + 1}", None, "after"),
        ("GET", "/api/rollouts/terminal?after=-1", None, "after"),
        ("GET", f"/api/rollouts/terminal?limit={BIG}", None, "limit"),
        ("GET", "/api/rollouts/terminal?limit=0", None, "limit"),
        ("GET", f"/api/rollouts?limit={BIG}", None, "limit"),
        ("GET", "/api/rollouts?limit=0", None, "limit"),
        ("GET", f"/proxy/state?wait_drained={BIG}", None, "wait_drained"),
        ("POST", "/api/models", [ENGINE | {"policy_version": INT64 + 1}], "policy_version"),
        ("POST", "/api/models", [ENGINE | {"policy_version": BIG}], "policy_version"),
        ("POST", "/api/models", [ENGINE | {"version": INT64 + 1}], "policy_version"),  # Agent Lightning's name
        ("POST", "/api/models", [ENGINE | {"policy_version": -1}], "policy_version"),
        ("POST", "/api/rollouts", [{"config": {"timeout_seconds": 2**31}}], "timeout_seconds"),
        ("POST", "/api/rollouts", [{"config": {"timeout_seconds": 1e300}}], "timeout_seconds"),
        ("POST", "/api/rollouts", [{"config": {"timeout_seconds": BIG}}], "timeout_seconds"),
        ("POST", "/api/rollouts", [{"config": {"timeout_seconds": 0}}], "timeout_seconds"),
        ("POST", "/proxy/pause", {"retry_after_seconds": BIG}, "retry_after_seconds"),
        ("POST", "/proxy/pause", {"expected_seconds": BIG}, "expected_seconds"),
    ],
)
def test_an_integer_out_of_range_is_a_4xx_naming_it_and_changes_nothing(admin, method, path, body, parameter):
    finished = running(admin)  # a finished rollout: the terminal cursor has a row to page over
    admin.patch(f"/api/rollouts/{finished}", json={"status": {"state": "succeeded"}}).raise_for_status()
    before = store_dump(admin), admin.get("/api/models").json(), admin.get("/proxy/state").json()
    refused = assert_refused(admin.request(method, path, json=body), 422)
    assert parameter in refused["reason"], refused
    assert (store_dump(admin), admin.get("/api/models").json(), admin.get("/proxy/state").json()) == before


def test_the_largest_cursor_is_an_empty_page(admin):
    finished = running(admin)
    admin.patch(f"/api/rollouts/{finished}", json={"status": {"state": "failed"}}).raise_for_status()
    first = admin.get("/api/rollouts/terminal").json()
    assert [i["rollout_id"] for i in first["items"]] == [finished] and first["next_after"] == 1
    last = admin.get("/api/rollouts/terminal", params={"after": INT64, "limit": 100000})
    assert last.status_code == 200, last.text
    assert last.json() == {"items": [], "next_after": INT64, "total_terminal": 1}


@pytest.mark.parametrize("version", [0, INT64])
def test_policy_versions_up_to_the_largest_are_registered(admin, version):
    registered = admin.post("/api/models", json=[{"model": "m", "endpoint": "http://e/v1", "version": version}])
    assert registered.status_code == 201, registered.text
    assert [m["policy_version"] for m in admin.get("/api/models").json()] == [version]
