"""Connection bounds: silent, slow and idle connections are closed in bounded time, and a
flood of them never keeps a normal client out for longer than that."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

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
