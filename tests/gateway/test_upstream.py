"""The proxy's engine client (`rollover.gateway.upstream`) against a scripted HTTP server: its
connections are reused, every way an answer can be framed is read, and every way a call can
fail is told apart (the proxy answers the agent differently for each)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rollover.gateway.upstream import ConnectFailed, Disconnected, UpstreamPool, UpstreamTimeout

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
Answer = Callable[[int, int, bytes, asyncio.StreamWriter], Awaitable[bool]]  # connection, call, body -> go on?


class Scripted:
    """A server whose `answer` writes each call's answer; it counts connections and calls."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.calls = 0
        self.bodies: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                self.calls += 1
                self.bodies.append(body)
                if not await self.answer(connection, self.calls, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[tuple[Scripted, str]]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> tuple[Scripted, str]:
        scripted = Scripted(answer)
        server = await asyncio.start_server(scripted._serve, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return scripted, f"http://127.0.0.1:{port}/v1/chat/completions"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def _ok(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
    writer.write(OK)
    return True


async def test_calls_in_turn_share_one_connection_and_bodies_go_as_bytes(serve):
    server, url = await serve(_ok)
    pool = UpstreamPool(timeout_seconds=30)
    for i in range(5):
        response = await pool.post(url, b'{"n":%d}' % i)
        assert response.status == 200 and await response.read() == b'{"ok":true}'
        response.release()
    assert server.connections == 1 and server.bodies == [b'{"n":%d}' % i for i in range(5)]
    pool.close()


async def test_overlapping_calls_get_a_connection_each(serve):
    async def slow(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        writer.write(OK)
        return True

    server, url = await serve(slow)
    pool = UpstreamPool(timeout_seconds=30)

    async def one() -> bytes:
        response = await pool.post(url, b"{}")
        try:
            return await response.read()
        finally:
            response.release()

    assert await asyncio.gather(*(one() for _ in range(4))) == [b'{"ok":true}'] * 4
    assert server.connections == 4
    await one()
    assert server.connections == 4  # reused afterwards
    pool.close()


async def test_a_chunked_answer_is_read_whole_or_piece_by_piece(serve):
    async def chunked(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        return True

    server, url = await serve(chunked)
    pool = UpstreamPool(timeout_seconds=30)
    response = await pool.post(url, b"{}")
    assert await response.read() == b"data: 1\n\ndata: 2\n\n"
    response.release()
    response = await pool.post(url, b"{}")
    assert b"".join([piece async for piece in response.chunks()]) == b"data: 1\n\ndata: 2\n\n"
    response.release()
    assert server.connections == 1
    pool.close()


async def test_an_answer_without_a_length_ends_with_its_connection(serve):
    async def until_close(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        return False

    server, url = await serve(until_close)
    pool = UpstreamPool(timeout_seconds=30)
    for _ in range(2):
        response = await pool.post(url, b"{}")
        assert await response.read() == b"all of it"
        response.release()
    assert server.connections == 2
    pool.close()


async def test_a_kept_connection_the_engine_dropped_unanswered_is_replaced_at_once(serve):
    async def drops_second_call(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if call == 2:
            return False  # closed as an idle connection is, just as the call arrived
        writer.write(OK)
        return True

    server, url = await serve(drops_second_call)
    pool = UpstreamPool(timeout_seconds=30)
    for _ in range(2):
        response = await pool.post(url, b"{}")
        assert await response.read() == b'{"ok":true}'
        response.release()
    assert server.connections == 2 and server.calls == 3
    pool.close()


async def test_a_new_connection_closed_unanswered_is_an_error_not_a_retry(serve):
    async def drops(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        return False

    server, url = await serve(drops)
    pool = UpstreamPool(timeout_seconds=30)
    with pytest.raises(Disconnected):
        await pool.post(url, b"{}")
    assert server.calls == 1
    pool.close()


async def test_an_answer_cut_off_midway_is_an_error(serve):
    async def cut(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial')
        return False

    _, url = await serve(cut)
    pool = UpstreamPool(timeout_seconds=30)
    response = await pool.post(url, b"{}")
    with pytest.raises(Disconnected):
        await response.read()
    response.release()
    pool.close()


async def test_nothing_listening_is_a_failed_connect(serve):
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectFailed):
        await UpstreamPool(timeout_seconds=30).post(f"http://127.0.0.1:{port}/v1/completions", b"{}")


async def test_an_engine_that_never_answers_times_out(serve):
    async def silent(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await writer.wait_closed()  # until the client gives up
        return False

    _, url = await serve(silent)
    pool = UpstreamPool(timeout_seconds=0.3)
    with pytest.raises(UpstreamTimeout):
        await pool.post(url, b"{}")
    pool.close()


async def test_an_answer_without_a_length_cut_off_by_a_reset_is_an_error(serve):
    async def reset(connection: int, call: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        writer.transport.abort()
        return False

    _, url = await serve(reset)
    pool = UpstreamPool(timeout_seconds=30)
    with pytest.raises(Disconnected):
        response = await pool.post(url, b"{}")
        await response.read()
    pool.close()


async def test_a_connection_idle_too_long_is_not_reused(serve):
    server, url = await serve(_ok)
    pool = UpstreamPool(timeout_seconds=30, idle_seconds=0)  # every kept connection is too old
    for _ in range(3):
        response = await pool.post(url, b"{}")
        assert await response.read() == b'{"ok":true}'
        response.release()
    assert server.connections == 3 and server.calls == 3
    pool.close()


async def test_a_call_cancelled_as_its_connection_is_made_leaves_it_closed(monkeypatch):
    """The cancel (an agent that hung up) lands once the connection exists and before the
    call has it: the connection must not stay open, held by nobody."""
    loop = asyncio.get_running_loop()
    made = asyncio.Event()
    transports = []

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    async def create_connection(factory, host, port, ssl=None):
        transport = Transport()
        transports.append(transport)
        factory().connection_made(transport)
        made.set()
        await asyncio.Event().wait()  # the handshake's last step, where the cancel lands

    monkeypatch.setattr(loop, "create_connection", create_connection)
    call = asyncio.create_task(UpstreamPool(timeout_seconds=30).post("http://127.0.0.1:9/v1/completions", b"{}"))
    await made.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert [t.aborted for t in transports] == [True]
