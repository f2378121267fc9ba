"""A proxied call's way back to its agent: a whole answer, cancelled upstream if the agent hangs
up first, or a stream relayed chunk by chunk; either way counted out of the in-flight calls
once the engine's connection is closed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from rollover.gateway.asgi import error_response, json_response
from rollover.gateway.calls import CALL_ID_HEADER, ProxyCall, UpstreamError
from rollover.gateway.proxy import Forwarder
from rollover.gateway.streamed import StreamedCall

DISCONNECT_CHECK_SECONDS = 0.5  # how often a proxied call still running checks that its agent is there
Leave = Callable[[], Awaitable[None]]  # counts the call out of the in-flight calls


class RelayedStream(StreamingResponse):
    """The engine's chunks (or `body`, what another API's translator makes of them), relayed as
    they arrive; whatever ends the response (the last chunk, the agent hanging up, an error)
    closes the engine call and then counts the call out."""

    def __init__(
        self, call: StreamedCall, leave: Leave, body: AsyncIterator[bytes] | None = None, call_id: str | None = None
    ) -> None:
        chunks = call.chunks() if body is None else body
        headers = {"Cache-Control": "no-cache"} | ({CALL_ID_HEADER: call_id} if call_id else {})
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self._call = call
        self._leave = leave

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await asyncio.shield(self._call.close())
            finally:
                await self._leave()


async def relay_stream(forwarder: Forwarder, call: ProxyCall, leave: Leave) -> Response:
    """A `stream: true` call (counted in flight by the caller): relayed, or the engine's error."""
    try:
        streamed = await forwarder.stream(call)
    except UpstreamError as exc:
        await leave()
        return error_response(exc.status_code, exc.error, exc.reason)
    except BaseException:
        await leave()
        raise
    if streamed.status == 200:
        return RelayedStream(streamed, leave, call_id=call.call_id)
    try:
        raw, _ = await streamed.read()
    except UpstreamError as exc:
        return error_response(exc.status_code, exc.error, exc.reason)
    finally:
        try:
            await streamed.close()
        finally:
            await leave()
    return json_response(raw, streamed.status)


async def forward_unless_disconnected(
    request: Request, forwarder: Forwarder, call: ProxyCall
) -> tuple[int, bytes, dict[str, Any]]:
    """Forward the call; if the agent hangs up first, cancel it so the engine stops generating.

    The call runs in the request's own task: a watcher for the agent hanging up is started only
    once it has taken `DISCONNECT_CHECK_SECONDS`, so the usual short call pays for a timer, not
    for a task of its own and the turns of the event loop that hand its result back."""
    task = asyncio.current_task()
    assert task is not None  # a request is served in a task
    hung_up = asyncio.Event()
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_CHECK_SECONDS)
        hung_up.set()
        task.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = asyncio.create_task(watch())

    timer = asyncio.get_running_loop().call_later(DISCONNECT_CHECK_SECONDS, start_watching)
    try:
        return await forwarder.forward(call)
    except asyncio.CancelledError:
        if not hung_up.is_set():
            raise  # cancelled from outside (the server shutting down)
        if sys.version_info >= (3, 11):
            task.uncancel()  # a cancel caught and turned into an answer: later awaits are not cancelled
        raise UpstreamError(499, "client disconnected; upstream call cancelled") from None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
