"""Every store-API endpoint fuzzed (hypothesis, bounded) with the admin key and a scoped key:
no 5xx, every error a JSON `{"error", "reason"}` (on the Anthropic and Responses routes, that
API's own error shape), the store file unchanged after every 4xx.
And the auth matrix: each endpoint against no key, wrong keys and the scoped keys of this
rollout, of an old attempt of it and of another rollout."""

from __future__ import annotations

import json
import re
import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY

RUN, QUEUED = "fz-run", "fz-queued"  # a running rollout (attempt a1) and a queued one


class Fuzzed:
    """A gateway over a store file, a stand-in upstream, and a way to read the file directly."""

    def __init__(self, gateway: GatewayThread, stub: StubUpstream, path: Path) -> None:
        self.gateway, self.stub, self.path = gateway, stub, path
        self.admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}, timeout=30)
        self.client = httpx.Client(base_url=gateway.url, timeout=30)  # no key of its own

    def reset(self) -> None:
        """Back to the fixtures: unpaused, the stub the one upstream, both rollouts present."""
        admin = self.admin
        admin.post("/proxy/resume").raise_for_status()
        admin.delete("/api/models").raise_for_status()
        # An engine that takes images (two a prompt), so image parts reach their checks.
        entry = {"model": "policy", "endpoint": self.stub.base_url, "max_images": 2}
        admin.post("/api/models", json=[entry]).raise_for_status()
        for rid in (RUN, QUEUED):
            state = admin.post("/api/rollouts", json=[{"rollout_id": rid, "input": {"q": 1}}]).json()[0]["status"]
            if state["state"] != ("running" if rid == RUN else "queuing") or (
                rid == RUN and state["last_attempt_id"] != "a1"
            ):
                admin.delete(f"/api/rollouts/{rid}").raise_for_status()
                admin.post("/api/rollouts", json=[{"rollout_id": rid, "input": {"q": 1}}]).raise_for_status()
                if rid == RUN:
                    claim = {"status": {"state": "running", "last_attempt_id": "a1"}}
                    admin.patch(f"/api/rollouts/{rid}", json=claim).raise_for_status()

    def rows(self) -> tuple[list[tuple[Any, ...]], ...]:
        """Every row of the store file, read past the gateway."""
        with closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)) as conn:
            return tuple(
                conn.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall()
                for table in ("rollouts", "attempts", "events", "images")
            )


@pytest.fixture
def fuzzed(tmp_path: Path) -> Iterator[Fuzzed]:
    path = tmp_path / "store.db"
    with StubUpstream() as stub, GatewayThread(store=str(path), admin_key=ADMIN_KEY, upstream_retries=0) as gateway:
        target = Fuzzed(gateway, stub, path)
        target.reset()
        yield target
        target.admin.close()
        target.client.close()


# -- what is sent ---------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
path_ids = st.sampled_from([RUN, QUEUED, "nope", "a1", ""]) | st.text(max_size=12)
attempt_ids = st.sampled_from(["a1", "a2", "0"]) | st.text(max_size=6)
RAW = [
    b"",
    b"{",
    b"[" * 300 + b"]" * 300,
    b"[" * 1100 + b"]" * 1100,
    b'{"input": "\\ud800"}',
    b'{"event_type": "reward", "data": {"value": NaN}}',
    b'{"event_type": "reward", "data": {"value": 1e999}}',
    b'{"event_type": "model_request", "data": {}}',
    b"\xff\xfe",
]
# Valid bodies per endpoint, which the fuzz then breaks one key at a time.
TEMPLATES: dict[str, Any] = {
    "rollouts": [{"input": {"q": 1}, "metadata": {"k": "v"}, "config": {"timeout_seconds": 5}}],
    "patch": {"status": {"state": "running", "last_attempt_id": "a9"}},
    "event": {"event_type": "reward", "data": {"value": 0.5}},
    "models": [{"model": "policy", "endpoint": "http://127.0.0.1:9/v1", "policy_version": 1}],
    "pause": {"reason": "fuzz", "retry_after_seconds": 1, "expected_seconds": 2},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "anthropic": {
        "model": "policy",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]},
        ],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "stream": False,
    },
    "responses": {
        "model": "policy",
        "instructions": "s",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "2"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "previous_response_id": None,
        "store": True,
    },
}


ATTEMPT_PATH = r"/proxy/rollout/[^/]+/attempt/[^/]+/mode/[^/]+"


def error_message(response: httpx.Response) -> str:
    """The refusal's reason, checked to be in the shape of the API the path serves (a path that
    is no route, such as one with an empty id, gets the router's answer in the gateway's shape).
    The path is the one the router sees: percent-decoded, so an id of "%2F" leaves an empty segment."""
    path, error = response.request.url.path, response.json()
    if re.fullmatch(ATTEMPT_PATH + r"/anthropic/v1/messages(/count_tokens)?", path):
        assert set(error) == {"type", "error"} and error["type"] == "error", error
        assert set(error["error"]) == {"type", "message"}, error
        return str(error["error"]["message"])
    if re.fullmatch(ATTEMPT_PATH + r"/openai/v1/responses", path):
        assert set(error) == {"error"} and {"message", "type"} <= set(error["error"]), error
        return str(error["error"]["message"])
    assert set(error) == {"error", "reason"}, error
    return str(error["reason"])


@st.composite
def bodies(draw: st.DrawFn, template: str) -> bytes:
    kind = draw(st.sampled_from(["template", "broken", "json", "raw"]))
    if kind == "raw":
        return draw(st.sampled_from(RAW) | st.binary(max_size=40))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()  # NaN and Infinity included: not JSON
    value = json.loads(json.dumps(TEMPLATES[template]))
    if kind == "broken":
        target = value[0] if isinstance(value, list) else value
        key = draw(st.sampled_from([*target.keys(), "extra"]))
        target[key] = draw(json_values)
    return json.dumps(value).encode()


def quoted(text: str) -> str:
    return urllib.parse.quote(text, safe="")


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, Any], bytes | None]:
    rid, aid = quoted(draw(path_ids)), quoted(draw(attempt_ids))
    mode = draw(st.sampled_from(["train", "val", "test"]))
    text = st.text(max_size=8)
    endpoint = draw(
        st.sampled_from(
            [
                ("POST", "/api/rollouts", "rollouts"),
                ("GET", "/api/rollouts", None),
                ("GET", f"/api/rollouts/{rid}", None),
                ("PATCH", f"/api/rollouts/{rid}", "patch"),
                ("DELETE", f"/api/rollouts/{rid}", None),
                ("POST", f"/api/rollouts/{rid}/attempt/{aid}/events", "event"),
                ("GET", f"/api/rollouts/{rid}/events", None),
                ("POST", "/api/models", "models"),
                ("GET", "/api/models", None),
                ("DELETE", "/api/models", None),
                ("POST", "/proxy/pause", "pause"),
                ("POST", "/proxy/resume", None),
                ("GET", "/proxy/state", None),
                ("POST", f"/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/openai/v1/chat/completions", "chat"),
                ("POST", f"/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/openai/v1/completions", "chat"),
                ("GET", f"/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/openai/v1/models", None),
                ("POST", f"/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/anthropic/v1/messages", "anthropic"),
                (
                    "POST",
                    f"/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/anthropic/v1/messages/count_tokens",
                    "anthropic",
                ),
                ("POST", f"/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/openai/v1/responses", "responses"),
            ]
        )
    )
    method, path, template = endpoint
    params = draw(
        st.dictionaries(
            st.sampled_from(["state_in", "limit", "rollout_id", "event_type", "attempt_id", "format", "wait_drained"]),
            text | st.sampled_from(["queuing", "-1", "0", "5", "triplet", "samples", "raw"]),
            max_size=3,
        )
    )
    body = draw(bodies(template)) if template else None
    return method, path, params, body


NO_ROUTE = f"/proxy/rollout/{quoted('/')}/attempt/a1/mode/train"
KEYS = {"admin": ADMIN_KEY, "agent": scoped_key(ADMIN_KEY, RUN, "a1")}


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples every run: a failure comes from a change, and reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests(), who=st.sampled_from(sorted(KEYS)))
# An id of "/" is an empty segment once decoded: no route, so the router's 404 in the gateway's shape.
@example(
    request=("POST", f"{NO_ROUTE}/anthropic/v1/messages", {}, json.dumps(TEMPLATES["anthropic"]).encode()), who="admin"
)
@example(
    request=("POST", f"{NO_ROUTE}/openai/v1/responses", {}, json.dumps(TEMPLATES["responses"]).encode()), who="admin"
)
def test_fuzzed_requests_never_5xx_and_refusals_change_nothing(fuzzed, request, who):
    method, path, params, body = request
    fuzzed.reset()
    before = fuzzed.rows()
    response = fuzzed.client.request(method, path, params=params, content=body, headers={"x-api-key": KEYS[who]})
    assert response.status_code < 500, (method, path, params, body, response.status_code, response.text)
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/json"), response.text
        assert error_message(response)
        assert fuzzed.rows() == before, (method, path, body, response.text)
    elif response.status_code < 300 and not response.headers["content-type"].startswith("text/event-stream"):
        response.json()  # 3xx: the router's redirect of a trailing slash


# -- the auth matrix --------------------------------------------------------------------

OTHER = "fz-other"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "policy", "input": "hi"}


def endpoints(upstream: str) -> list[tuple[str, str, Any, str]]:
    """(method, path, body, kind): admin endpoints, reads of RUN, writes into RUN's running
    attempt a2, and writes into its finished attempt a1."""
    return [
        ("POST", "/api/rollouts", [{"input": 1}], "admin"),
        ("GET", "/api/rollouts", None, "admin"),
        ("PATCH", f"/api/rollouts/{QUEUED}", {"status": {"k8s_job_name": "j"}}, "admin"),
        ("DELETE", "/api/rollouts/fz-doomed", None, "admin"),
        ("POST", "/api/models", [{"model": "policy", "endpoint": upstream}], "admin"),
        ("GET", "/api/models", None, "admin"),
        ("POST", "/proxy/pause", {}, "admin"),
        ("POST", "/proxy/resume", None, "admin"),
        ("GET", "/proxy/state", None, "admin"),
        ("GET", "/openapi.json", None, "admin"),
        ("GET", "/docs", None, "admin"),
        ("GET", "/redoc", None, "admin"),
        ("GET", f"/api/rollouts/{RUN}", None, "read"),
        ("GET", f"/api/rollouts/{RUN}/events?format=samples", None, "read"),
        ("GET", f"/proxy/rollout/{RUN}/attempt/a2/mode/train/openai/v1/models", None, "read"),
        ("POST", f"/api/rollouts/{RUN}/attempt/a2/events", {"event_type": "note", "data": {}}, "write"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a2/mode/train/openai/v1/chat/completions", CHAT, "write"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a2/mode/train/anthropic/v1/messages", MESSAGES, "write"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a2/mode/train/anthropic/v1/messages/count_tokens", MESSAGES, "write"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a2/mode/train/openai/v1/responses", RESPONSES, "write"),
        ("POST", f"/api/rollouts/{RUN}/attempt/a1/events", {"event_type": "note", "data": {}}, "old"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a1/mode/train/openai/v1/chat/completions", CHAT, "old"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a1/mode/train/anthropic/v1/messages", MESSAGES, "old"),
        ("POST", f"/proxy/rollout/{RUN}/attempt/a1/mode/train/openai/v1/responses", RESPONSES, "old"),
        ("DELETE", "/api/models", None, "admin"),  # last: the proxy calls above need the upstream
    ]


# What each key gets on each kind of endpoint (2xx: served).
EXPECTED = {
    "none": {"admin": 401, "read": 401, "write": 401, "old": 401},
    "wrong": {"admin": 401, "read": 401, "write": 401, "old": 401},
    "forged scoped": {"admin": 403, "read": 403, "write": 403, "old": 403},
    "this attempt": {"admin": 403, "read": "2xx", "write": "2xx", "old": 403},
    "old attempt": {"admin": 403, "read": "2xx", "write": 403, "old": 409},
    "other rollout": {"admin": 403, "read": 403, "write": 403, "old": 403},
    "admin": {"admin": "2xx", "read": "2xx", "write": "2xx", "old": "2xx"},  # the admin may write anywhere
}


def test_auth_matrix_on_every_endpoint(fuzzed):
    admin = fuzzed.admin
    # RUN: attempt a1 failed and re-queued, a2 running; OTHER running its own a1.
    admin.patch(f"/api/rollouts/{RUN}", json={"status": {"state": "queuing"}}).raise_for_status()
    admin.patch(f"/api/rollouts/{RUN}", json={"status": {"state": "running", "last_attempt_id": "a2"}})
    admin.post("/api/rollouts", json=[{"rollout_id": OTHER}, {"rollout_id": "fz-doomed"}]).raise_for_status()
    claim = {"status": {"state": "running", "last_attempt_id": "a1"}}
    admin.patch(f"/api/rollouts/{OTHER}", json=claim).raise_for_status()
    keys: dict[str, str | None] = {
        "none": None,
        "wrong": "not-the-key",
        "forged scoped": "rk-" + "0" * 40,
        "this attempt": scoped_key(ADMIN_KEY, RUN, "a2"),
        "old attempt": scoped_key(ADMIN_KEY, RUN, "a1"),
        "other rollout": scoped_key(ADMIN_KEY, OTHER, "a1"),
        "admin": ADMIN_KEY,  # last: its DELETEs and pause go through
    }
    seen = []
    for who, key in keys.items():
        for method, path, body, kind in endpoints(fuzzed.stub.base_url):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            before = fuzzed.rows()
            response = fuzzed.client.request(method, path, json=body, headers=headers)
            expected = EXPECTED[who][kind]
            got = "2xx" if 200 <= response.status_code < 300 else response.status_code
            seen.append((who, method, path, got))
            assert got == expected, (who, method, path, response.status_code, response.text)
            if got != "2xx":
                assert error_message(response)
                assert fuzzed.rows() == before, (who, method, path)
    assert httpx.get(f"{fuzzed.gateway.url}/healthz").status_code == 200  # the one endpoint with no key
    assert len(seen) == len(keys) * len(endpoints(""))


# -- image parts ------------------------------------------------------------------------


def _png(size: tuple[int, int] = (28, 28)) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, "white").save(buffer, "PNG")
    return buffer.getvalue()


PNG = _png()


@st.composite
def image_urls(draw: st.DrawFn) -> str:
    """A valid image's data: URL, or one broken in a way an agent might break it."""
    import base64

    kind = draw(
        st.sampled_from(["valid", "truncated", "flipped", "bytes", "text", "http", "media", "no-base64", "padding"])
    )
    data = PNG
    if kind == "truncated":
        data = PNG[: draw(st.integers(0, len(PNG) - 1))]
    elif kind == "flipped":
        at = draw(st.integers(0, len(PNG) - 1))
        data = PNG[:at] + bytes([PNG[at] ^ 0xFF]) + PNG[at + 1 :]
    elif kind == "bytes":
        data = draw(st.binary(max_size=64))
    encoded = base64.b64encode(data).decode()
    if kind == "text":
        return draw(st.text(max_size=40))
    if kind == "http":
        return "https://example.com/" + draw(st.text(max_size=10))
    if kind == "media":
        return f"data:{draw(st.text(max_size=12))};base64,{encoded}"
    if kind == "no-base64":
        return "data:image/png," + encoded
    if kind == "padding":
        return "data:image/png;base64," + encoded[: draw(st.integers(0, len(encoded)))] + draw(st.text(max_size=3))
    return "data:image/png;base64," + encoded


@st.composite
def image_requests(draw: st.DrawFn) -> tuple[str, Any]:
    """A call with 0 to 3 image parts (the engine takes 2) on one of the three routes, the parts
    sometimes malformed around the URL too."""
    route = draw(st.sampled_from(["chat", "anthropic", "responses"]))
    urls = draw(st.lists(image_urls(), max_size=3))
    odd = draw(st.sampled_from([None, None, None, "number", "list", "object"]))
    if route == "chat":
        parts: list[Any] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        if odd is not None:
            parts.append({"type": "image_url", "image_url": {"number": 1, "list": [], "object": {}}[odd]})
        return route, {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}
    if route == "anthropic":
        blocks: list[Any] = [{"type": "image", "source": {"type": "url", "url": url}} for url in urls]
        if odd is not None:
            blocks.append({"type": "image", "source": {"type": "base64", "media_type": 1, "data": [odd]}})
        blocks.append({"type": "text", "text": "hi"})
        return route, {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}
    items: list[Any] = [{"type": "input_image", "image_url": url} for url in urls]
    if odd is not None:
        items.append({"type": "input_image", "file_id": odd})
    return route, {
        "model": "policy",
        "input": [{"role": "user", "content": [*items, {"type": "input_text", "text": "hi"}]}],
    }


IMAGE_PATHS = {
    "chat": f"/proxy/rollout/{RUN}/attempt/a1/mode/train/openai/v1/chat/completions",
    "anthropic": f"/proxy/rollout/{RUN}/attempt/a1/mode/train/anthropic/v1/messages",
    "responses": f"/proxy/rollout/{RUN}/attempt/a1/mode/train/openai/v1/responses",
}


@pytest.mark.slow
@settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples every run: a failure comes from a change, and reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=image_requests())
def test_fuzzed_image_parts_never_5xx_and_refusals_change_nothing(fuzzed, request):
    """Every image part is taken (the store then holds each image once) or refused with a 400
    that names why, in the route's shape; a refusal leaves the store as it was and no answer
    repeats the image's data."""
    import base64

    route, body = request
    fuzzed.reset()
    before = fuzzed.rows()
    path = IMAGE_PATHS[route]
    response = fuzzed.client.post(path, json=body, headers={"x-api-key": KEYS["agent"]})
    assert response.status_code in (200, 400), (route, body, response.status_code, response.text)
    if response.status_code == 400:
        assert error_message(response)
        assert fuzzed.rows() == before, (route, body, response.text)
    else:
        images = fuzzed.rows()[3]
        assert len(images) == len({row[0] for row in images})  # each content once
    assert base64.b64encode(PNG).decode()[:32] not in response.text
