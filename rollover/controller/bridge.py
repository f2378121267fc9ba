"""The sandbox's one way out: the gateway, through a Unix socket.

Sandboxed agents live in a network namespace with loopback only. Inside it, a bridge process
listens on 127.0.0.1:<gateway port> and carries each connection to a Unix socket bound into
the sandbox; outside, the controller's `GatewayRelay` serves that socket and carries each
connection on to the gateway's TCP address. Bytes pass unchanged both ways (HTTP, streaming,
keep-alive), so agents use the gateway's usual URLs and keys; nothing else is reachable.

`python -m rollover.controller.bridge --listen-fd N --unix PATH` is the inside half,
`--listen-fd N --tcp HOST:PORT` the outside one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollover.processes import exit_if_orphaned

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
    """The outside half, a process of its own (the trainer's event loop and GIL stay out of
    every agent call): a Unix socket in a private folder whose every connection goes on to the
    gateway at `host:port`. The socket listens before the process starts, so no connection
    is refused while it comes up; the process dies with the controller."""

    def __init__(self, host: str, port: int, socket_path: Path, log_path: Path) -> None:
        self.host = host
        self.port = port
        self.socket_path = socket_path
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.socket_path))
            listener.listen(1024)
            with open(self.log_path, "ab") as log:
                self._process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "rollover.controller.bridge",
                        "--listen-fd",
                        str(listener.fileno()),
                        "--tcp",
                        f"{self.host}:{self.port}",
                        "--parent-pid",
                        str(os.getpid()),
                    ],
                    pass_fds=(listener.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
        finally:
            listener.close()

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), 5)
        except asyncio.TimeoutError:
            process.kill()
            await asyncio.to_thread(process.wait)


def listen_loopback(port: int) -> socket.socket:
    """The inside half's listening socket, made before the bridge runs, so that agents that
    connect before it is up wait in the backlog instead of being refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


async def _serve(listen_fd: int, open_peer: Callable[[], Awaitable[Streams]]) -> None:
    """Relay every connection until SIGTERM, then close the open ones and return."""
    sock = socket.socket(fileno=listen_fd)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await relay(reader, writer, open_peer)

    if sock.family == socket.AF_UNIX:
        server = await asyncio.start_unix_server(handle, sock=sock)
    else:
        server = await asyncio.start_server(handle, sock=sock)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollover.controller.bridge")
    parser.add_argument("--listen-fd", type=int, required=True, help="a listening socket (TCP or Unix)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--unix", help="carry each connection to this Unix socket (inside the sandbox)")
    where.add_argument("--tcp", help="carry each connection to this HOST:PORT (outside: the gateway)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies (0: do not watch)")
    args = parser.parse_args(argv)
    if args.parent_pid:
        exit_if_orphaned(args.parent_pid, signal.SIGTERM)
    open_peer: Callable[[], Awaitable[Streams]]
    if args.unix:
        path = args.unix
        open_peer = lambda: asyncio.open_unix_connection(path)  # noqa: E731
    else:
        host, _, port = args.tcp.rpartition(":")
        open_peer = lambda: asyncio.open_connection(host, int(port))  # noqa: E731
    try:
        asyncio.run(_serve(args.listen_fd, open_peer))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
