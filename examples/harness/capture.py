"""What a harness sends, as the engine sees it: the harness runs unchanged against Rollover's
real gateway, whose upstream is a scripted engine on loopback that keeps every chat request and
answers from a script (a tool call while the tool's result is not in, then a text answer).

The warm-up transcripts are built from these requests (`prepare.py`), so the tiny model learns
on exactly the prompts (system prompt, tools, message layout) that the harness will send during
training, rendered by the same gateway translation. Nothing of a harness's text is kept in the
repository: it is captured when the model is built.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread

ADMIN_KEY = "capture-admin-key"


@dataclass
class Script:
    """The engine's part: the call it makes first (`name`, JSON `arguments`), then `answer`."""

    name: str
    arguments: dict[str, Any]
    answer: str
    requests: list[dict[str, Any]] = field(default_factory=list)

    def reply(self, body: dict[str, Any]) -> tuple[str | None, str]:
        """(tool name or None, text or arguments) for one chat request."""
        messages = body.get("messages") or []
        called = any(isinstance(m, dict) and m.get("role") == "tool" for m in messages)
        names = [(t.get("function") or {}).get("name") for t in body.get("tools") or []]
        if self.name in names and not called:
            return self.name, json.dumps(self.arguments)
        return None, self.answer


def _chunks(tool: str | None, text: str, model: str) -> Iterator[dict[str, Any]]:
    base = {"id": "chatcmpl-capture", "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    yield base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    if tool is None:
        delta: dict[str, Any] = {"content": text}
    else:
        call = {"index": 0, "id": "call_capture", "type": "function", "function": {"name": tool, "arguments": text}}
        delta = {"tool_calls": [call]}
    finish = "stop" if tool is None else "tool_calls"
    yield base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    yield base | {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _completion(tool: str | None, text: str, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if tool is None else None}
    if tool is not None:
        message["tool_calls"] = [
            {"id": "call_capture", "type": "function", "function": {"name": tool, "arguments": text}}
        ]
    return {
        "id": "chatcmpl-capture",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop" if tool is None else "tool_calls"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@contextmanager
def scripted_engine(script: Script) -> Iterator[str]:
    """A chat/completions server on loopback that answers from `script`; yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._send(200, "application/json", json.dumps({"data": [{"id": "policy"}]}).encode())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if not self.path.endswith("/chat/completions"):
                self._send(404, "application/json", b'{"error": {"message": "chat/completions only"}}')
                return
            script.requests.append(body)
            tool, text = script.reply(body)
            model = str(body.get("model"))
            if body.get("stream"):
                data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in _chunks(tool, text, model))
                self._send(200, "text/event-stream", data + b"data: [DONE]\n\n")
            else:
                self._send(200, "application/json", json.dumps(_completion(tool, text, model)).encode())

        def _send(self, status: int, kind: str, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def capture(script: Script) -> Iterator[dict[str, str]]:
    """A running rollout behind a real gateway whose engine is `script`; yields the standard
    variables an agent of that rollout gets (as the controller sets them: `harness_env`)."""
    from rollover.controller.agent_env import harness_env

    with scripted_engine(script) as engine, GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as gateway:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as admin:
            admin.post("/api/models", json=[{"model": "policy", "endpoint": engine}]).raise_for_status()
            created = admin.post("/api/rollouts", json=[{"input": {}, "is_train": True}])
            rollout_id = created.raise_for_status().json()[0]["rollout_id"]
            admin.patch(
                f"/api/rollouts/{rollout_id}", json={"status": {"state": "running", "last_attempt_id": "a1"}}
            ).raise_for_status()
        base = f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/a1/mode/train/openai/v1"
        yield harness_env({"AGL_OPENAI_BASE_URL": base, "AGL_KEY": scoped_key(ADMIN_KEY, rollout_id, "a1")})
