"""Images through the recording proxy, on the chat, Anthropic and Responses routes, against the
stand-in engine registered as one that takes images: what the engine gets (the image as sent),
what is recorded (references, the images once by content hash), and every refusal a 400 naming
its limit, never a 500 and never echoing the image's data."""

from __future__ import annotations

import base64
import io
import logging
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from rollover.gateway.images import REFERENCE_PREFIX, restore_images
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout


def png(width: int = 56, height: int = 28, color: str = "white", fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*urls: str, text: str = "what is it?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": "policy", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


class Served:
    def __init__(self, gateway: GatewayThread, stub: StubUpstream, path: Path) -> None:
        self.gateway, self.stub, self.path = gateway, stub, path
        self.admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}, timeout=30)

    def register(self, max_images: int) -> None:
        self.admin.delete("/api/models")
        entry = {"model": "policy", "endpoint": self.stub.base_url, "max_images": max_images}
        self.admin.post("/api/models", json=[entry]).raise_for_status()

    def post(self, rid: str, body: Any, route: str = "chat") -> httpx.Response:
        base = f"{self.gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train"
        url = {
            "chat": proxy_url(self.gateway, rid),
            "anthropic": base + "/anthropic/v1/messages",
            "responses": base + "/openai/v1/responses",
        }[route]
        return httpx.post(url, json=body, headers=agent_headers(rid), timeout=30)

    def records(self, rid: str) -> list[dict[str, Any]]:
        events = self.admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
        return [e["data"] for e in events]

    def stored_images(self) -> list[tuple[str, str, int]]:
        with closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)) as conn:
            return conn.execute("SELECT sha256, media_type, length(data) FROM images ORDER BY sha256").fetchall()


@pytest.fixture
def served(tmp_path: Path):
    path = tmp_path / "store.db"
    with (
        StubUpstream() as stub,
        GatewayThread(store=str(path), admin_key=ADMIN_KEY, upstream_retries=0, max_image_bytes=20_000) as gateway,
    ):
        target = Served(gateway, stub, path)
        target.register(max_images=2)
        yield target
        target.admin.close()


def test_an_image_reaches_the_engine_as_sent_and_is_recorded_by_reference(served) -> None:
    import hashlib

    rid = running_rollout(served.admin)
    image = png()
    url = data_url(image)
    response = served.post(rid, chat(url))
    assert response.status_code == 200, response.text
    sent = served.stub.behaviour.requests[-1]
    assert sent["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": url}}
    [record] = served.records(rid)
    sha = hashlib.sha256(image).hexdigest()
    assert record["images"] == [
        {"sha256": sha, "media_type": "image/png", "width": 56, "height": 28, "bytes": len(image)}
    ]
    assert record["request"]["messages"][0]["content"][0]["image_url"]["url"] == REFERENCE_PREFIX + sha
    assert record["prompt_token_ids"] == response.json()["prompt_token_ids"]
    # The bytes are the store's, once, and the admin reads them back as they were sent.
    assert served.stored_images() == [(sha, "image/png", len(image))]
    fetched = served.admin.get(f"/api/images/{sha}")
    assert fetched.status_code == 200 and fetched.content == image
    assert fetched.headers["content-type"] == "image/png"
    agent = httpx.get(f"{served.gateway.url}/api/images/{sha}", headers=agent_headers(rid))
    assert agent.status_code == 403
    assert served.admin.get("/api/images/" + "0" * 64).status_code == 404


def test_a_screenshot_resent_every_turn_is_stored_once(served) -> None:
    rid = running_rollout(served.admin)
    screenshot = data_url(png(112, 56, "navy"))
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": screenshot}}]}
    ]
    for turn in range(10):  # the whole context, screenshot included, every turn
        assert served.post(rid, {"model": "policy", "messages": messages}).status_code == 200
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"turn {turn}"}]
    records = served.records(rid)
    assert len(records) == 10 and all(r["images"][0]["width"] == 112 for r in records)
    assert len(served.stored_images()) == 1


@pytest.mark.parametrize("route", ["anthropic", "responses"])
def test_the_other_apis_images_reach_the_engine_as_image_url_parts(served, route: str) -> None:
    rid = running_rollout(served.admin)
    image = png(color="red")
    encoded = base64.b64encode(image).decode()
    if route == "anthropic":
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}}
        body = {
            "model": "policy",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "what is it?"}]}],
        }
    else:
        part = {"type": "input_image", "image_url": data_url(image)}
        body = {
            "model": "policy",
            "input": [{"role": "user", "content": [part, {"type": "input_text", "text": "what is it?"}]}],
        }
    response = served.post(rid, body, route)
    assert response.status_code == 200, response.text
    sent = served.stub.behaviour.requests[-1]
    assert sent["messages"][-1]["content"] == [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is it?"},
    ]
    [record] = served.records(rid)
    assert record["api"]["name"] == route and record["images"][0]["bytes"] == len(image)
    assert encoded not in str(record)


def test_an_anthropic_screenshot_in_a_tool_result_is_an_image_of_the_tool_turn(served) -> None:
    rid = running_rollout(served.admin)
    image = png(color="green")
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()},
    }
    body = {
        "model": "policy",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]},
        ],
    }
    assert served.post(rid, body, "anthropic").status_code == 200
    sent = served.stub.behaviour.requests[-1]
    assert sent["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}],
    }


BAD = [
    ("https://example.com/cat.png", "no network"),
    ("data:image/png;base64,%%%%", "not valid base64"),
    ("data:image/png," + "abc", "must be base64"),
    (data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), "not a readable image"),
    (data_url(png(fmt="BMP"), "image/bmp"), "BMP images are not taken"),
    (data_url(png(400, 400, "white", "BMP")[:30_000], "image/bmp"), "gateway.max_image_bytes"),
    ("ftp://example.com/x.png", "only data: URLs"),
]


@pytest.mark.parametrize(("url", "reason"), BAD, ids=[reason for _, reason in BAD])
def test_a_bad_image_is_a_400_naming_why_and_changes_nothing(served, url: str, reason: str) -> None:
    rid = running_rollout(served.admin)
    response = served.post(rid, chat(url))
    assert response.status_code == 400, response.text
    assert reason in response.json()["reason"] and "messages.0.content.0" in response.json()["reason"]
    assert served.stub.behaviour.requests == [] and served.records(rid) == []
    assert served.stored_images() == []


@pytest.mark.parametrize("route", ["chat", "anthropic", "responses"])
def test_more_images_than_the_engine_takes_and_any_image_to_a_text_model_are_400s(served, route: str) -> None:
    rid = running_rollout(served.admin)
    url = data_url(png())

    def body(count: int) -> dict[str, Any]:
        if route == "chat":
            return chat(*[url] * count)
        if route == "anthropic":
            block = {"type": "image", "source": {"type": "url", "url": url}}
            return {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": [block] * count}]}
        part = {"type": "input_image", "image_url": url}
        return {"model": "policy", "input": [{"role": "user", "content": [part] * count}]}

    def reason(response: httpx.Response) -> str:
        error = response.json()
        return str(error["reason"] if route == "chat" else error["error"]["message"])

    too_many = served.post(rid, body(3), route)
    assert too_many.status_code == 400 and "at most 2" in reason(too_many) and "limit_images" in reason(too_many)
    served.register(max_images=0)
    text_only = served.post(rid, body(1), route)
    assert text_only.status_code == 400 and "takes no images (a text-only model)" in reason(text_only)
    assert served.stub.behaviour.requests == [] and served.stored_images() == []


def test_an_http_image_on_the_other_apis_is_refused_in_their_shape(served) -> None:
    rid = running_rollout(served.admin)
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}
    anthropic = served.post(
        rid, {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}, "anthropic"
    )
    assert anthropic.status_code == 400
    assert anthropic.json()["error"]["message"].startswith(
        "messages.0.content.0.source.url: image URLs are not fetched"
    )
    part = {"type": "input_image", "file_id": "file-1"}
    responses = served.post(rid, {"model": "policy", "input": [{"role": "user", "content": [part]}]}, "responses")
    assert responses.status_code == 400 and "not by file_id" in responses.json()["error"]["message"]


def test_a_50_mb_body_is_refused_before_it_is_parsed(served) -> None:
    rid = running_rollout(served.admin)
    # Not JSON at all: had it been parsed, the answer would be a 400.
    body = b"{" + b"A" * (50 * 1024 * 1024)
    for route in ("chat", "anthropic"):
        url = (
            proxy_url(served.gateway, rid)
            if route == "chat"
            else proxy_url(served.gateway, rid).replace("openai/v1/chat/completions", "anthropic/v1/messages")
        )
        response = httpx.post(url, content=body, headers=agent_headers(rid), timeout=60)
        assert response.status_code == 413, response.text[:200]
        assert "gateway.max_body_bytes" in response.text


def test_no_log_line_view_or_error_carries_an_images_data(served, caplog) -> None:
    rid = running_rollout(served.admin)
    image = png(64, 64, "purple")
    encoded = base64.b64encode(image).decode()
    caplog.set_level(logging.DEBUG)
    assert served.post(rid, chat(data_url(image))).status_code == 200
    corrupt = base64.b64encode(image[:-40] + b"\x00" * 40).decode()
    for body in (chat(f"data:image/png;base64,{corrupt}"), chat(*[data_url(image)] * 3)):
        refused = served.post(rid, body)
        assert refused.status_code == 400 and encoded[:40] not in refused.text and corrupt[:40] not in refused.text
    views = [
        served.admin.get(f"/api/rollouts/{rid}/events").text,
        served.admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).text,
        served.admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).text,
        served.admin.get("/proxy/state").text,
    ]
    for text in [*views, caplog.text]:
        assert encoded[:40] not in text and corrupt[:40] not in text


def test_a_recorded_request_gets_its_images_back_inline() -> None:
    image = png()
    body = chat(REFERENCE_PREFIX + "abc", text="x")
    restored = restore_images(body, {"abc": ("image/png", image)})
    assert restored["messages"][0]["content"][0]["image_url"]["url"] == data_url(image)
    assert body["messages"][0]["content"][0]["image_url"]["url"] == REFERENCE_PREFIX + "abc"  # not changed in place


def test_previous_response_id_continues_with_the_earlier_image_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    image_url = data_url(png(color="orange"))
    with StubUpstream() as stub:
        with GatewayThread(store=str(path), admin_key=ADMIN_KEY) as gateway:
            admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY})
            admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "max_images": 1}])
            rid = running_rollout(admin)
            url = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/responses"
            headers = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}
            part = {"type": "input_image", "image_url": image_url}
            first = httpx.post(
                url, json={"model": "policy", "input": [{"role": "user", "content": [part]}]}, headers=headers
            )
            assert first.status_code == 200, first.text
        with GatewayThread(store=str(path), admin_key=ADMIN_KEY) as gateway:
            url = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/responses"
            body = {"model": "policy", "input": "and now?", "previous_response_id": first.json()["id"]}
            second = httpx.post(url, json=body, headers=headers)
            assert second.status_code == 200, second.text
        sent = stub.behaviour.requests[-1]
        assert sent["messages"][0]["content"] == [{"type": "image_url", "image_url": {"url": image_url}}]


@pytest.mark.parametrize("route", ["chat", "anthropic"])
def test_a_streamed_call_records_its_images_too(served, route: str) -> None:
    rid = running_rollout(served.admin)
    image = png(color="yellow")
    if route == "chat":
        body = chat(data_url(image)) | {"stream": True}
    else:
        block = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()},
        }
        body = {"model": "policy", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": [block]}]}
    response = served.post(rid, body, route)
    assert response.status_code == 200 and "data:" in response.text
    [record] = served.records(rid)
    assert record["images"][0]["bytes"] == len(image) and len(served.stored_images()) == 1
    assert base64.b64encode(image).decode()[:40] not in str(record)
