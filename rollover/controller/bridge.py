"""The sandbox's one way out: the gateway, through a Unix socket.

Sandboxed agents live in a network namespace with loopback only. Inside it, a bridge process
listens on 127.0.0.1:<gateway port> and carries each connection to a Unix socket bound into
the sandbox; outside, the controller's `GatewayRelay` serves that socket and carries each
connection on to the gateway's TCP address. Bytes pass unchanged both ways (HTTP, streaming,
keep-alive), so agents use the gateway's usual URLs and keys; nothing else is reachable.

`python -m rollover.controller.bridge --listen-fd N --socket PATH` is the inside half.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, open_peer: Callable[[], Awaitable[Streams]]
) -> None:
    """Carry one accepted connection to a fresh connection of `open_peer`, both ways, until
    both sides are done; a peer that cannot be reached closes the connection."""
    try:
        peer_reader, peer_writer = await open_peer()
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(_pipe(reader, peer_writer), _pipe(peer_reader, writer))
    finally:
        for w in (writer, peer_writer):
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()


class GatewayRelay:
    """The outside half: a Unix socket in a private folder whose every connection goes on to
    the gateway at `host:port`."""

    def __init__(self, host: str, port: int, socket_path: Path) -> None:
        self.host = host
        self.port = port
        self.socket_path = socket_path
        self._server: asyncio.AbstractServer | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await relay(reader, writer, lambda: asyncio.open_connection(self.host, self.port))

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None


def listen_loopback(port: int) -> socket.socket:
    """The inside half's listening socket, made before the bridge runs, so that agents that
    connect before it is up wait in the backlog instead of being refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


async def _serve(listen_fd: int, socket_path: str) -> None:
    sock = socket.socket(fileno=listen_fd)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await relay(reader, writer, lambda: asyncio.open_unix_connection(socket_path))

    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollover.controller.bridge")
    parser.add_argument("--listen-fd", type=int, required=True, help="a listening TCP socket")
    parser.add_argument("--socket", required=True, help="the Unix socket that leads to the gateway")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.listen_fd, args.socket))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
