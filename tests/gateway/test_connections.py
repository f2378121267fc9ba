"""Connection bounds: silent, slow and idle connections are closed in bounded time, and a
flood of them never keeps a normal client out for longer than that. And a response is sent in
one write."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from rollover.gateway.connections import bounded_protocol
from rollover.gateway.server import GatewayThread
from tests.conftest import ADMIN_KEY

HEADER_TIMEOUT = 2.0
CAP = 20


@pytest.fixture
def bounded() -> Iterator[GatewayThread]:
    settings = {"max_connections": CAP, "header_timeout_seconds": HEADER_TIMEOUT, "keep_alive_seconds": 1}
    with GatewayThread(store=":memory:", admin_key=ADMIN_KEY, **settings) as server:
        yield server


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (reading until it does)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def open_silent(server: GatewayThread, count: int) -> list[socket.socket]:
    return [socket.create_connection((server.host, server.port), timeout=10) for _ in range(count)]


def served_within(server: GatewayThread, seconds: float) -> float:
    """Seconds until a normal client (a fresh connection per try) gets its answer."""
    started = time.monotonic()
    while True:
        try:
            response = httpx.get(f"{server.url}/api/rollouts", headers={"x-api-key": ADMIN_KEY}, timeout=5)
            assert response.status_code == 200
            return time.monotonic() - started
        except httpx.TransportError:
            assert time.monotonic() - started < seconds, "a normal client was kept out"
            time.sleep(0.2)


@pytest.mark.slow
def test_a_flood_of_silent_connections_does_not_keep_a_client_out(bounded):
    silent = open_silent(bounded, 3 * CAP)
    try:
        # Over the cap they are closed as they are accepted, the rest after the header
        # timeout: the client is served at the latest once those are gone (10x margin).
        assert served_within(bounded, 10 * HEADER_TIMEOUT) < 10 * HEADER_TIMEOUT
        for sock in silent:
            assert closed_by_server(sock, 10 * HEADER_TIMEOUT)
    finally:
        for sock in silent:
            sock.close()
    assert served_within(bounded, 10 * HEADER_TIMEOUT) < 10 * HEADER_TIMEOUT


def test_headers_sent_too_slowly_and_idle_keep_alive_connections_are_closed(bounded):
    slow = socket.create_connection((bounded.host, bounded.port), timeout=10)
    idle = socket.create_connection((bounded.host, bounded.port), timeout=10)
    try:
        slow.sendall(b"GET /api/rollouts HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
        idle.sendall(f"GET /api/rollouts HTTP/1.1\r\nHost: x\r\nx-api-key: {ADMIN_KEY}\r\n\r\n".encode())
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        assert closed_by_server(slow, 10 * HEADER_TIMEOUT)
        assert closed_by_server(idle, 10.0)  # keep_alive_seconds=1
    finally:
        slow.close()
        idle.close()


def test_a_later_request_whose_headers_stall_on_a_kept_alive_connection_is_closed(bounded):
    with socket.create_connection((bounded.host, bounded.port), timeout=10) as kept:
        kept.sendall(f"GET /api/rollouts HTTP/1.1\r\nHost: x\r\nx-api-key: {ADMIN_KEY}\r\n\r\n".encode())
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        # The next request's first bytes end the keep-alive wait; then its headers never end.
        kept.sendall(b"GET /api/rollouts HTTP/1.1\r\nHost: x\r\n")
        assert closed_by_server(kept, 10 * HEADER_TIMEOUT)


class RecordingTransport(asyncio.Transport):
    """What a response writes, call by call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def _two_part_response(scope: dict, receive: object, send) -> None:  # type: ignore[no-untyped-def]
    if scope["path"] == "/stream":  # a chunk now, another a turn of the loop later
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"second"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


def test_a_response_goes_out_in_one_write_and_a_stream_chunk_by_chunk() -> None:
    async def serve(path: str) -> list[bytes]:
        config = uvicorn.Config(_two_part_response, http=bounded_protocol(10, 5.0), lifespan="off")
        config.load()
        protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if transport.writes and transport.writes[-1].endswith(b"0\r\n\r\n" if path == "/stream" else b"hello"):
                break
        protocol.connection_lost(None)
        return transport.writes

    [whole] = asyncio.run(serve("/plain"))  # uvicorn alone writes the head and the body apart
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and whole.endswith(b"\r\n\r\nhello")
    first, second = asyncio.run(serve("/stream"))  # nothing is held past its turn of the loop
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"5\r\nfirst\r\n")
    assert second == b"6\r\nsecond\r\n0\r\n\r\n"
