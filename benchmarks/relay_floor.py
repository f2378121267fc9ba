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

Usage: python benchmarks/relay_floor.py --port 8100 --upstream http://127.0.0.1:8000/v1 [--record FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools
import uvloop


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
        if self.recorded is not None:
            self.recorded.recorder.commit(self.recorded.asked.popleft(), body)
        self.answer.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (self.parser.get_status_code(), len(body), body)
        )

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost()  # the upstream closed an idle connection (its keep-alive timeout)


class _Recorded:
    """A client connection's requests waiting for their answers, and where they are recorded."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.asked: deque[bytes] = deque()


class _Relay(asyncio.Protocol):
    def __init__(self, host: str, port: int, path: bytes, recorder: Recorder | None) -> None:
        self.host, self.port, self.path = host, port, path
        self.recorded = None if recorder is None else _Recorded(recorder)
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.pending: deque[bytes] = deque()
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
            self._send(self.pending.popleft())

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body.clear()
        if self.parser.get_method() != b"POST":  # the readiness probe (`wait_healthy`), before any load
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            return
        if self.upstream is None:
            self.pending.append(body)
        else:
            self._send(body)

    def _send(self, body: bytes) -> None:
        assert self.upstream is not None and self.upstream.transport is not None
        if self.recorded is not None:
            self.recorded.asked.append(body)
        self.upstream.transport.write(
            b"POST %s HTTP/1.1\r\nhost: upstream\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (self.path, len(body), body)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        upstream, self.upstream, self.transport = self.upstream, None, None
        if upstream is not None and upstream.transport is not None:
            upstream.transport.close()


async def serve(port: int, upstream: str, record: str | None) -> None:
    parts = urlsplit(upstream)
    assert parts.hostname and parts.port, f"--upstream needs a host and a port: {upstream}"
    path = f"{parts.path.rstrip('/')}/chat/completions".encode()
    loop = asyncio.get_running_loop()
    recorder = None if record is None else Recorder(record)
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
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream, args.record))


if __name__ == "__main__":
    main()
