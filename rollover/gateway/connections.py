"""Bounds on the gateway's client connections: how many, and how long one may take to send a
request's headers.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) but not the others: a
connection that never sends a request holds its file descriptor forever, and its
`limit_concurrency` counts such connections and then refuses the requests of the live ones
(a plain-text 503). Here a connection over `max_connections` is closed as it is accepted, and
one that has not sent a request's headers within `header_timeout_seconds` (from its opening,
or from the first byte of a later request) is closed, so silent connections come and go and
never lock the others out for longer than that.

It also sends each response in one write: uvicorn writes a response's head and its body
separately, two TCP segments that wake the agent twice per call; here what a response writes
within one turn of the event loop goes out together (`_CoalescedWrites`).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap and a header timeout (see the module)."""

    max_connections = 512
    header_timeout_seconds = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _reading_headers = False  # a request has begun and its headers are not all in

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # connection_lost follows and forgets it
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A later request on a kept-alive connection whose headers did not all come in this
        # read. (Armed here, not at its first byte: most requests come whole, and a timer
        # armed and cancelled per request is a cost every proxied call would pay.)
        if self._reading_headers and self._header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._cancel_header_timer()
        super().on_headers_complete()
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.scope is self.scope and cycle.transport is self.transport:
            cycle.transport = _CoalescedWrites(self.transport, self.loop)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_seconds, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(max_connections: int, header_timeout_seconds: float) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http=` with these bounds."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {"max_connections": max_connections, "header_timeout_seconds": header_timeout_seconds},
    )


class _CoalescedWrites:
    """The part of a transport a response uses (`write`, `close`, `is_closing`), with the writes
    made in one turn of the event loop sent as one: held until the turn ends, or until the
    response closes the connection."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(data)

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()
