"""The least a Python gateway can cost on this machine: an HTTP relay that does nothing else.

It runs as its own process on uvloop with httptools (what Rollover's gateway runs on) and
passes each POST's body to the upstream and the answer back, over one kept-alive upstream
connection per client connection (opened again when the upstream closes it idle); any other
request gets `200 {}` (a readiness check). No routing, auth, JSON, pause state or store. The overhead benchmark (`gateway_overhead.py
--floor`) measures it beside the real gateway: its added latency is what two more loopback
hops and a process on the path cost before the gateway does any work.

With `--record FILE` each answer is first committed to a SQLite file (WAL, synchronous=NORMAL,
as the gateway's store) as one row holding the request and the answer, and only then written
back: the least durable recording adds to a relay (`floor+record` in the benchmark's table).

With `--proxy-work ADMIN_KEY` as well it does, with Rollover's own functions, the per-call work
of the gateway's chat route at concurrency 1 (`floor+proxy`): the attempt's scoped key checked
from the proxy path, the body parsed and its fields checked, the engine's request prepared (mode,
token ids, logprobs, its call id), the answer parsed, its tokens extracted and the call recorded
as the gateway records it (a `model_request` event and its `calls` row, in the gateway's schema)
before the answer goes back with its call id. What it leaves out: the pause admission, policies
and retries, images, partial rollout, streams, the rollout's state check, group commit, the
body and connection limits. It is what a proxy path written straight on the HTTP parser, with no
ASGI server, framework or per-request task, could cost.

With `--asgi` too the same work is a bare ASGI app under uvicorn, with the gateway's HTTP
protocol (`bounded_protocol`) and its client to the engine (`UpstreamPool`), and no framework
(`floor+asgi`): what uvicorn and a task per request cost before Rollover's app does anything.

Usage: python benchmarks/relay_floor.py --port 8100 --upstream http://127.0.0.1:8000/v1
           [--record FILE [--proxy-work ADMIN_KEY [--asgi]]]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools
import uvicorn
import uvloop

from rollover import codec
from rollover.config import GatewaySettings
from rollover.gateway.calls import CALL_ID_HEADER, new_call_id
from rollover.gateway.connections import bounded_protocol
from rollover.gateway.keys import is_attempt_key
from rollover.gateway.proxy import extract_tokens, prepare_request
from rollover.gateway.sampling import check_request
from rollover.gateway.upstream import UpstreamPool
from rollover.store.file import SCHEMA, connect
from rollover.store.sqlite import INSERT_CALL, INSERT_EVENT


class Recording(Protocol):
    """What a relay that records does with each call: `ask` turns the agent's request into what
    it holds for the answer and the body it sends on (None: refused, 401); `answered` records
    the call and returns the headers (name, value) the answer gets besides."""

    def ask(self, url: bytes, authorization: bytes | None, body: bytes) -> tuple[Any, bytes] | None: ...

    def answered(self, asked: Any, status: int, raw: bytes) -> list[tuple[bytes, bytes]]: ...


class Recorder:
    """Each call committed as one row of a SQLite file before its answer goes back."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("CREATE TABLE IF NOT EXISTS calls (id INTEGER PRIMARY KEY, request BLOB, answer BLOB)")

    def commit(self, request: bytes, answer: bytes) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute("INSERT INTO calls (request, answer) VALUES (?, ?)", (request, answer))
        self.conn.execute("COMMIT")

    def ask(self, url: bytes, authorization: bytes | None, body: bytes) -> tuple[bytes, bytes]:
        return body, body  # the request as sent, kept for its row

    def answered(self, asked: bytes, status: int, raw: bytes) -> list[tuple[bytes, bytes]]:
        self.commit(asked, raw)
        return []


@dataclass(frozen=True)
class _Asked:
    """A call sent on, waiting for its answer."""

    rollout_id: str
    attempt_id: str
    mode: str
    request: dict[str, Any]
    call_id: str
    started: float


class ProxyWork:
    """The gateway chat route's per-call work (see the module), done in the parser's callbacks."""

    ENDPOINT = "chat/completions"
    SERVED = "policy"  # the model name the engine serves (the gateway's registered model)

    def __init__(self, path: str, admin_key: str) -> None:
        self.admin_key = admin_key
        self.settings = GatewaySettings.from_config(store=":memory:", admin_key=admin_key)
        self.conn = connect(path, "NORMAL")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.executescript(SCHEMA)
        self.next_event_id = 1

    def ask(self, url: bytes, authorization: bytes | None, body: bytes) -> tuple[_Asked, bytes] | None:
        """The call and the engine's request, or None when the key does not open the attempt."""
        # /proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/openai/v1/chat/completions
        parts = url.decode().split("/")
        rollout_id, attempt_id, mode = parts[3], parts[5], parts[7]
        scheme, _, key = (authorization or b"").decode().partition(" ")
        if scheme.lower() != "bearer" or not is_attempt_key(self.admin_key, key, rollout_id, attempt_id):
            return None
        request = codec.loads(body)
        check_request(request, self.ENDPOINT, mode, self.settings.max_n)
        call_id = new_call_id()
        upstream = prepare_request(request, self.ENDPOINT, mode, self.SERVED, self.settings)
        upstream["request_id"] = call_id
        asked = _Asked(rollout_id, attempt_id, mode, request, call_id, time.monotonic())
        return asked, codec.dumps(upstream)

    def answered(self, asked: _Asked, status: int, raw: bytes) -> list[tuple[bytes, bytes]]:
        """The call recorded as the gateway records it, committed; its call id's header."""
        data = codec.loads(raw)
        record = {
            "mode": asked.mode,
            "endpoint": self.ENDPOINT,
            "model": self.SERVED,
            "upstream": "upstream",
            "request": asked.request,
            "response": data,
            "policy_version": 0,
            "latency_s": time.monotonic() - asked.started,
            "status_code": status,
            "call_id": asked.call_id,
        }
        record.update(extract_tokens(self.ENDPOINT, data))
        event_id, self.next_event_id = self.next_event_id, self.next_event_id + 1
        where = (asked.rollout_id, asked.attempt_id)
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute(INSERT_EVENT, (event_id, *where, "model_request", codec.dumps_str(record), time.time()))
        self.conn.execute(INSERT_CALL, (asked.call_id, *where, event_id))
        self.conn.execute("COMMIT")
        return [(CALL_ID_HEADER.encode(), asked.call_id.encode())]


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to the upstream; answers go back in the order asked."""

    def __init__(self, answer: asyncio.Transport, lost: Callable[[], None], recorded: _Recorded | None) -> None:
        self.answer = answer
        self.lost = lost
        self.recorded = recorded
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body.clear()
        status, headers = self.parser.get_status_code(), b""
        if self.recorded is not None:
            answered = self.recorded.recorder.answered(self.recorded.asked.popleft(), status, body)
            headers = b"".join(b"%s: %s\r\n" % header for header in answered)
        self.answer.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
            % (status, headers, len(body), body)
        )

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost()  # the upstream closed an idle connection (its keep-alive timeout)


class _Recorded:
    """A client connection's requests waiting for their answers, and where they are recorded."""

    def __init__(self, recorder: Recording) -> None:
        self.recorder = recorder
        self.asked: deque[Any] = deque()  # what `recorder.ask` kept of each


class _Relay(asyncio.Protocol):
    def __init__(self, host: str, port: int, path: bytes, recorder: Recording | None) -> None:
        self.host, self.port, self.path = host, port, path
        self.recorded = None if recorder is None else _Recorded(recorder)
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.url = b""
        self.authorization: bytes | None = None
        self.pending: deque[tuple[Any, bytes]] = deque()  # (what the recorder kept, body to send)
        self.upstream: _Upstream | None = None
        self.connecting = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._reconnect()

    def _reconnect(self) -> None:
        self.upstream = None
        if not self.connecting and self.transport is not None and not self.transport.is_closing():
            self.connecting = True
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        _, upstream = await asyncio.get_running_loop().create_connection(
            lambda: _Upstream(self.transport, self._reconnect, self.recorded),
            self.host,
            self.port,  # type: ignore[arg-type]
        )
        self.upstream, self.connecting = upstream, False
        while self.pending:
            self._send(*self.pending.popleft())

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.authorization = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, url, authorization = b"".join(self.body), self.url, self.authorization
        self.body.clear()
        self.url, self.authorization = b"", None
        assert self.transport is not None
        if self.parser.get_method() != b"POST":  # the readiness probe (`wait_healthy`), before any load
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            return
        asked: Any = None
        if self.recorded is not None:
            found = self.recorded.recorder.ask(url, authorization, body)
            if found is None:
                self.transport.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")
                return
            asked, body = found
        if self.upstream is None:
            self.pending.append((asked, body))
        else:
            self._send(asked, body)

    def _send(self, asked: Any, body: bytes) -> None:
        assert self.upstream is not None and self.upstream.transport is not None
        if self.recorded is not None:
            self.recorded.asked.append(asked)
        self.upstream.transport.write(
            b"POST %s HTTP/1.1\r\nhost: upstream\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (self.path, len(body), body)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        upstream, self.upstream, self.transport = self.upstream, None, None
        if upstream is not None and upstream.transport is not None:
            upstream.transport.close()


class AsgiProxyWork:
    """`ProxyWork` as a bare ASGI app under uvicorn with the gateway's protocol, calling the
    engine with the gateway's own client (`--asgi`): what the same per-call work costs with
    uvicorn and a per-request task in place of the parser's callbacks, and no framework."""

    def __init__(self, work: ProxyWork, upstream: str) -> None:
        self.work = work
        self.url = f"{upstream.rstrip('/')}/chat/completions"
        self.pool = UpstreamPool(60.0)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":  # the readiness probe
            await self._answer(send, 200, b"{}", [])
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        found = self.work.ask(scope["path"].encode(), authorization, b"".join(chunks))
        if found is None:
            await self._answer(send, 401, b"", [])
            return
        asked, body = found
        response = await self.pool.post(self.url, body)
        raw = await response.read()
        status = response.status
        response.release()
        await self._answer(send, status, raw, self.work.answered(asked, status, raw))

    @staticmethod
    async def _answer(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def serve_asgi(port: int, upstream: str, record: str, admin_key: str) -> None:
    app = AsgiProxyWork(ProxyWork(record, admin_key), upstream)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        lifespan="off",
        http=bounded_protocol(512, 10.0),
    )
    await uvicorn.Server(config).serve()


async def serve(port: int, upstream: str, record: str | None, proxy_work: str | None = None) -> None:
    parts = urlsplit(upstream)
    assert parts.hostname and parts.port, f"--upstream needs a host and a port: {upstream}"
    path = f"{parts.path.rstrip('/')}/chat/completions".encode()
    loop = asyncio.get_running_loop()
    recorder: Recording | None = None
    if record is not None:
        recorder = Recorder(record) if proxy_work is None else ProxyWork(record, proxy_work)
    server = await loop.create_server(lambda: _Relay(parts.hostname, parts.port, path, recorder), "127.0.0.1", port)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's OpenAI base URL (…/v1)")
    parser.add_argument("--record", help="commit each call to this SQLite file before answering")
    parser.add_argument("--proxy-work", metavar="ADMIN_KEY", help="do the gateway's per-call work (with --record)")
    parser.add_argument("--asgi", action="store_true", help="the per-call work as an ASGI app under uvicorn")
    args = parser.parse_args()
    if args.proxy_work is not None and args.record is None:
        parser.error("--proxy-work records into the --record file: give both")
    if args.asgi:
        if args.proxy_work is None:
            parser.error("--asgi serves the per-call work: give --record and --proxy-work")
        uvloop.run(serve_asgi(args.port, args.upstream, args.record, args.proxy_work))
    else:
        uvloop.run(serve(args.port, args.upstream, args.record, args.proxy_work))


if __name__ == "__main__":
    main()
