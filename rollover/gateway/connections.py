"""Bounds on the gateway's client connections: how many, and how long one may take to send a
request's headers.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) but not the others: a
connection that never sends a request holds its file descriptor forever, and its
`limit_concurrency` counts such connections and then refuses the requests of the live ones
(a plain-text 503). Here a connection over `max_connections` is closed as it is accepted, and
one that has not sent a request's headers within `header_timeout_seconds` (from its opening,
or from the first byte of a later request) is closed, so silent connections come and go and
never lock the others out for longer than that.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap and a header timeout (see the module)."""

    max_connections = 512
    header_timeout_seconds = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # connection_lost follows and forgets it
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a later request on a kept-alive connection
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

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
