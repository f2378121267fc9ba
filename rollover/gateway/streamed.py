"""A streamed engine answer, open: relayed to its agent chunk by chunk (or as another API's
events), or put together whole, and recorded once at its end (`StreamedCall`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from rollover.gateway.calls import Call, UpstreamError, parsed, read_whole, sse_error
from rollover.gateway.streaming import StreamAssembler, StreamTranslator
from rollover.gateway.upstream import UpstreamIOError, UpstreamResponse, UpstreamTimeout

# Records a finished call: the call, its status, its answer, the version it began with and
# per choice the versions that sampled its tokens (`Forwarder.record`).
Record = Callable[[Call, int, dict[str, Any], "int | None", "dict[int, list[list[int]]] | None"], Awaitable[None]]


class StreamedCall:
    """A streamed engine answer, open: `status` as the engine answered; an error body is read
    whole (`read`), a 200 is relayed chunk by chunk (`chunks`) or put together whole
    (`assemble`) while a `StreamAssembler` puts the completion back together, recorded as one
    `model_request` like an unstreamed call just before the agent gets the stream's end (so the
    record is there before the agent can finish); a stream cut off is not recorded, as an
    unstreamed call cut off is not. `close` (always, once done) releases the engine's
    connection, or closes it if the stream did not reach its end, which is how the engine
    learns to stop generating.

    Given the policy `version` it began with, it follows the versions of its tokens: `mark`
    at each weight load of its engine."""

    def __init__(
        self,
        record: Record,
        call: Call,
        stack: AsyncExitStack,
        response: UpstreamResponse,
        version: int | None = None,
        translator: StreamTranslator | None = None,
    ):
        self._record_call = record
        self._call = call
        self._stack = stack
        self._response = response
        self._version = version
        self._translator = translator
        listener = translator.chunk if translator is not None else None
        self._assembler = StreamAssembler(call.proxied.endpoint, version, listener)
        self._arrived: list[bytes] = []  # fed to the assembler by `mark`, not yet relayed
        self._finished = False  # the engine's answer was read to its end
        self._recorded = False
        self._closed = False
        self.status = response.status

    async def read(self) -> tuple[bytes, dict[str, Any]]:
        raw = await read_whole(self._response)
        self._finished = True
        raw, data = parsed(raw)
        await self._record(data)
        return raw, data

    async def _record(self, data: dict[str, Any]) -> None:
        if not self._recorded:
            self._recorded = True
            spans = self._assembler.spans if self._version is not None else None
            await self._record_call(self._call, self.status, data, self._version, spans)

    def mark(self, version: int) -> int:
        """Its engine now has the weights of `version`: what has arrived was sampled before
        them (read now, so the assembler counts it), what arrives from now on with them.
        Returns the tokens under way before the load (0: none, or the answer was complete)."""
        self._arrived += self._fed(self._response.received())
        self._response.wake()  # a relay waiting for more relays these
        under_way = 0 if self._assembler.done else self._assembler.tokens_under_way()
        self._assembler.mark(version)
        return under_way

    def _fed(self, pieces: list[bytes]) -> list[bytes]:
        for piece in pieces:
            self._assembler.feed(piece)
        return pieces

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, each piece fed to the assembler; the call recorded at its end."""
        while True:
            pieces, self._arrived = self._arrived + self._fed(self._response.received()), []
            for piece in pieces:
                if self._assembler.done:
                    await self._record(self._assembler.response())
                yield piece
            if self._arrived:  # read by a `mark` meanwhile
                continue
            if self._response.complete:
                break
            await self._response.wait()
        self._finished = True
        await self._record(self._assembler.response())  # an engine that sent no [DONE]

    async def chunks(self) -> AsyncIterator[bytes]:
        # Headers are sent: a failure is told in-band, as OpenAI's clients read it.
        try:
            async for piece in self._pieces():
                yield piece
        except UpstreamIOError as exc:
            yield sse_error(f"upstream failed mid-stream: {exc}")
        except UpstreamError as exc:  # the answer could not be recorded
            yield sse_error(exc.reason)

    async def events(self, on_answer: Callable[[dict[str, Any]], None] | None = None) -> AsyncIterator[bytes]:
        """The answer as the translator's events (another API's stream), told in-band when it
        fails after the headers went out; `on_answer` gets the whole answer once complete."""
        translator = self._translator
        assert translator is not None, "events() relays a translated call"
        try:
            async for _ in self._pieces():
                out = translator.take()
                if out:
                    yield out
        except UpstreamIOError as exc:
            yield translator.failed(f"upstream failed mid-stream: {exc}")
            return
        except UpstreamError as exc:  # the answer could not be recorded
            yield translator.failed(exc.reason)
            return
        answer = self._assembler.response()
        if answer.get("error") is not None:
            yield translator.failed(f"upstream failed mid-answer: {answer['error']}")
        else:
            if on_answer is not None:
                on_answer(answer)
            yield translator.end(answer)

    async def assemble(self) -> dict[str, Any]:
        """The whole answer, as the engine answers without `stream`, for an agent that did not
        ask for a stream; an engine that failed on the way is `UpstreamError` as a whole call's."""
        try:
            async for _ in self._pieces():
                pass
        except UpstreamTimeout as exc:
            raise UpstreamError(504, f"upstream timed out: {exc}") from None
        except UpstreamIOError as exc:
            raise UpstreamError(502, f"upstream failed mid-answer: {exc}") from None
        data = self._assembler.response()
        if data.get("error") is not None:
            raise UpstreamError(502, f"upstream failed mid-answer: {data['error']}")
        return data

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self._finished:
                self._response.close()
        finally:
            await self._stack.aclose()
