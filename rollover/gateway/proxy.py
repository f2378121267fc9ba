"""The recording OpenAI-compatible proxy: a call to the engine, its retries and its record (with
partial rollout, each token's policy version)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from rollover import codec
from rollover.config import GatewaySettings
from rollover.gateway.boundaries import Boundaries
from rollover.gateway.registry import ModelRegistry
from rollover.gateway.streaming import StreamAssembler
from rollover.gateway.upstream import ConnectFailed, UpstreamIOError, UpstreamPool, UpstreamResponse, UpstreamTimeout
from rollover.retry import RetryPolicy, call_with_retries
from rollover.store.models import ModelEndpoint
from rollover.store.sqlite import InvalidValue, RolloutStore

Mode = Literal["train", "val"]
ENDPOINTS = ("chat/completions", "completions")
log = logging.getLogger("rollover.gateway.proxy")
RETRY_BACKOFF_SECONDS = 0.5  # first pause between upstream retries; doubles each retry


@dataclass(frozen=True)
class ProxyCall:
    """One agent call as the proxy got it: whose it is, the mode, the OpenAI endpoint and body."""

    rollout_id: str
    attempt_id: str
    mode: Mode
    endpoint: str
    body: dict[str, Any]


class _RetryableUpstream(Exception):
    """A failed engine call worth trying again: its status for the agent, and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Unreachable(_RetryableUpstream):
    """The engine could not be connected to: nothing listens there (it died, or is restarting)."""


class UpstreamError(Exception):
    """A call that ends in an HTTP error for the agent: `{"error": error, "reason": reason}`."""

    def __init__(self, status_code: int, reason: str, error: str = "upstream error") -> None:
        super().__init__(reason)
        self.status_code = status_code
        self.reason = reason
        self.error = error


def served_model(target: ModelEndpoint, requested: Any) -> tuple[str, str | None]:
    """The model name to ask `target` for and the policy the agent picked by the `model` it
    asked for; with no `policies` the endpoint's one model whatever was asked (policy None), as
    before policies existed. A call asking for no policy of the endpoint's is refused (404) rather
    than sent to one of them: its record would train a policy the agent did not mean."""
    if not target.policies:
        return target.model, None
    if isinstance(requested, str) and requested in target.policies:
        return target.policies[requested], requested
    asked = "the call names no model" if requested is None else f"model {requested!r:.200} is not a policy of this run"
    names = ", ".join(repr(name) for name in sorted(target.policies))
    raise UpstreamError(404, f"{asked}: ask for one of {names}", error="not found")


def prepare_request(
    body: dict[str, Any], endpoint: str, mode: Mode, model: str, settings: GatewaySettings
) -> dict[str, Any]:
    """Force the served model, the mode's temperature, token ids and (train) logprobs, and cap
    the response at `max_response_tokens` unless the agent asks for less."""
    upstream = dict(body)
    upstream["model"] = model
    upstream["temperature"] = settings.train_temperature if mode == "train" else settings.val_temperature
    upstream["return_token_ids"] = True
    cap = settings.max_response_tokens
    if cap is not None:
        # verl caps generation at its response length too: a small model left unbounded runs
        # to the context limit and one update then takes minutes. An agent may ask for less.
        names = ("max_completion_tokens", "max_tokens") if endpoint == "chat/completions" else ("max_tokens",)
        asked = [v for v in (body.get(n) for n in names) if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        upstream["max_tokens"] = min([cap, *asked])
        if "max_completion_tokens" in upstream:
            upstream["max_completion_tokens"] = upstream["max_tokens"]
    # A stream is relayed as the engine writes it (its chunks carry token ids and logprobs too).
    streaming = body.get("stream") is True
    upstream["stream"] = streaming or settings.partial_rollout
    if settings.partial_rollout:
        # Streamed from the engine whatever the agent asked, so the gateway sees each token
        # arrive and knows which weights sampled it (an agent that asked for no stream gets the
        # answer whole, put back together). Tokens the engine held back to send several at
        # once could cross a weight load unseen.
        upstream.pop("stream_interval", None)
        if not streaming:
            upstream["stream_options"] = {"include_usage": True}
    elif not streaming:
        upstream.pop("stream_options", None)
    if mode == "train":
        # Sample from the full temperature-1 softmax the trainer optimises, whatever the agent
        # asked for, so the recorded logprobs are the behaviour policy's.
        upstream.update(top_p=1.0, top_k=-1, min_p=0.0)
        if endpoint == "chat/completions":
            upstream["logprobs"] = True
        elif not isinstance(upstream.get("logprobs"), int) or isinstance(upstream.get("logprobs"), bool):
            upstream["logprobs"] = 0
    return upstream


def extract_tokens(
    endpoint: str, response: dict[str, Any], spans: dict[int, list[list[int]]] | None = None
) -> dict[str, Any]:
    """Token ids and sampled-token logprobs of a vLLM response: its first choice's at the top
    level (as a call is recorded), and when it has several (`n` > 1) every choice's under
    `choices`, each becoming its own training sample. `spans` (partial rollout): per choice
    index, the policy versions that sampled its tokens (`response_version_spans`)."""
    choices = [c for c in response.get("choices") or [] if isinstance(c, dict)] or [{}]
    per_choice = [_choice_tokens(endpoint, response, choice) for choice in choices]
    if spans is not None:
        for position, (choice, found) in enumerate(zip(choices, per_choice)):
            found["response_version_spans"] = spans.get(choice.get("index", position), [])
    tokens = dict(per_choice[0])
    if len(per_choice) > 1:
        tokens["choices"] = [
            {"index": choice.get("index", position)} | {k: v for k, v in found.items() if k != "prompt_token_ids"}
            for position, (choice, found) in enumerate(zip(choices, per_choice))
        ]
    return tokens


def _choice_tokens(endpoint: str, response: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    if endpoint == "chat/completions":
        prompt_ids = response.get("prompt_token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = [item.get("logprob") for item in content] if content else None
    else:
        prompt_ids = choice.get("prompt_token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if logprobs is not None and not all(_finite(x) for x in logprobs):
        # A NaN or infinite logprob is no behaviour logprob: the call is kept as one recorded
        # without logprobs (the trainer's documented case), not with nulls in the list.
        logprobs = None
    return {
        "prompt_token_ids": prompt_ids,
        "response_token_ids": choice.get("token_ids"),
        "response_logprobs": logprobs,
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Forwarder:
    """Calls the upstream engine with retries on 5xx and timeouts, and records the call.

    The client is `UpstreamPool`: its connection pool stays linear as calls queue up (httpx's
    degraded to ~45 calls/s at 64 concurrent here, against ~440/s), and it hands bodies over
    as bytes, so the engine's answer reaches the agent as the engine wrote it."""

    def __init__(
        self,
        store: RolloutStore,
        registry: ModelRegistry,
        settings: GatewaySettings,
        save_registry: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        # Called after the proxy took an unreachable endpoint out of rotation (to persist it).
        self.save_registry = save_registry
        self._pool = UpstreamPool(settings.gateway.upstream_timeout_seconds)
        self.boundaries = Boundaries(self._pool.freeze, self._pool.thaw)

    async def aclose(self) -> None:
        self._pool.close()

    async def _post(self, url: str, payload: bytes) -> UpstreamResponse:
        """One try: the response, body unread, when its status will not be retried; an engine
        that cannot be connected to raised as `_Unreachable`, a timeout, a cut-off connection
        or a 5xx as `_RetryableUpstream`."""
        try:
            response = await self._pool.post(url, payload)
        except UpstreamTimeout as exc:
            raise _RetryableUpstream(504, f"upstream timed out: {exc}") from None
        except ConnectFailed as exc:
            raise _Unreachable(503, f"upstream unreachable at {url}: {exc}") from None
        except UpstreamIOError as exc:
            raise _RetryableUpstream(503, f"upstream unreachable at {url}: {exc}") from None
        if response.status >= 500:
            try:
                text = (await response.read())[:500].decode(errors="replace")
            except UpstreamIOError as exc:
                text = str(exc)
            response.release()
            raise _RetryableUpstream(502, f"upstream returned {response.status}: {text}")
        return response

    async def _post_live(self, call: ProxyCall) -> _Sent:
        """One try on the endpoint the rollout's hashing picks among the live ones, asked for the
        policy the call names when it serves several (`served_model`). One that
        cannot be connected to (its engine is down) is taken out of rotation, persisted, and
        the call sent at once to the next pick: the other rollouts stay where they are. The
        last live one is not taken out: with nowhere to move the call, it is retried there
        (`_RetryableUpstream`) as with one engine. None live: `UpstreamError` 503."""
        payloads: dict[str, bytes] = {}
        last: _Unreachable | None = None
        # Bounded: each failed connect takes an endpoint out or finds it replaced.
        for _ in range(len(self.registry.endpoints) + 1):
            target = self.registry.pick(call.rollout_id)
            if target is None:
                if not self.registry.endpoints:
                    raise UpstreamError(503, "no inference endpoint registered (POST /api/models first)")
                raise UpstreamError(
                    503, f"no live inference endpoint ({len(self.registry.endpoints)} registered, all out of rotation)"
                )
            model, policy = served_model(target, call.body.get("model"))
            payload = payloads.get(model)  # by the served name: each policy's request names its own
            if payload is None:
                payload = payloads[model] = codec.dumps(
                    prepare_request(call.body, call.endpoint, call.mode, model, self.settings)
                )
            try:
                response = await self._post(f"{target.endpoint.rstrip('/')}/{call.endpoint}", payload)
                return _Sent(target, response, model, policy)
            except _Unreachable as exc:
                last = exc
                if self.registry.take_out(target):
                    log.warning("%s: taken out of rotation until it registers again", exc.reason)
                    if self.save_registry is not None:
                        await self.save_registry()
                elif self.registry.pick(call.rollout_id) is target:
                    raise  # the last live endpoint
        assert last is not None
        raise last

    async def _send_with_retries(self, call: ProxyCall) -> _Sent:
        """`_post_live`, retried `gateway.upstream_retries` times. The first try goes without
        the retry machinery (27 us a call, measured): this is every agent call's path."""
        attempts = self.settings.gateway.upstream_retries + 1
        try:
            return await self._post_live(call)
        except _RetryableUpstream as first:
            if attempts == 1:
                raise UpstreamError(first.status, f"{first.reason} (after 1 attempt)") from None
        await asyncio.sleep(RETRY_BACKOFF_SECONDS)
        policy = RetryPolicy(
            lambda exc: isinstance(exc, _RetryableUpstream),
            attempts=attempts - 1,
            first_wait=RETRY_BACKOFF_SECONDS * 2,
            max_wait=RETRY_BACKOFF_SECONDS * 2**attempts,
        )
        try:
            return await call_with_retries(
                f"engine call for rollout {call.rollout_id}",
                lambda: self._post_live(call),
                policy,
                log,
            )
        except _RetryableUpstream as exc:
            raise UpstreamError(exc.status, f"{exc.reason} (after {attempts} attempts)") from None

    @asynccontextmanager
    async def open(self, call: ProxyCall) -> AsyncIterator[_Sent]:
        """The endpoint that answered and its response, once its status says it will not be
        retried, body unread: a caller reads it whole (`forward`) or relays it as it streams.
        Leaving early (the agent hung up) closes the connection, which is how the engine
        learns to stop."""
        sent = await self._send_with_retries(call)
        try:
            yield sent
        except BaseException:
            sent.response.close()
            raise
        finally:
            sent.response.release()

    async def forward(self, call: ProxyCall) -> tuple[int, bytes, dict[str, Any]]:
        """The engine's status, its body as sent, and that body parsed; the call is recorded.
        With partial rollout it is streamed from the engine and put back together (see
        `prepare_request`): the agent gets the one answer it asked for."""
        if self.settings.partial_rollout:
            return await self._forward_streamed(call)
        started = time.monotonic()
        async with self.open(call) as sent:
            raw = await _read_whole(sent.response)
            status_code = sent.response.status
        raw, data = _parsed(raw)
        await self.record(_Call(call, sent, started), status_code, data)
        return status_code, raw, data

    async def _forward_streamed(self, call: ProxyCall) -> tuple[int, bytes, dict[str, Any]]:
        streamed = await self.stream(call)
        try:
            if streamed.status != 200:
                raw, data = await streamed.read()
                return streamed.status, raw, data
            data = await streamed.assemble()
            return 200, codec.dumps(data), data
        finally:
            await streamed.close()

    async def stream(self, call: ProxyCall) -> StreamedCall:
        """The engine's answer, opened and streamed: see `StreamedCall`."""
        started = time.monotonic()
        stack = AsyncExitStack()
        sent = await stack.enter_async_context(self.open(call))
        version = None
        if self.settings.partial_rollout:
            # The version now, not the one at the pick: a call that reached an engine frozen for
            # a load, or one whose answer began after its weights changed, is the new weights'.
            version = self.registry.version_of(sent.target.endpoint, sent.target.policy_version)
        streamed = StreamedCall(self, _Call(call, sent, started), stack, sent.response, version)
        if version is not None:
            self.boundaries.track(sent.target.endpoint, streamed)
            stack.callback(self.boundaries.untrack, sent.target.endpoint, streamed)
        return streamed

    def registered(self, changes: list[tuple[ModelEndpoint | None, ModelEndpoint]]) -> None:
        """Engines (re-)registered, each with what it replaced: see `Boundaries.registered`."""
        for before, after in changes:
            self.boundaries.registered(before, after)

    async def record(
        self,
        call: _Call,
        status_code: int,
        data: dict[str, Any],
        version: int | None = None,
        spans: dict[int, list[list[int]]] | None = None,
    ) -> None:
        """Record the call. `version`: the policy version it began with when versions were
        followed (else its engine's at the pick); `spans`: per choice, the versions that
        sampled its tokens."""
        proxied = call.proxied
        record = {
            "mode": proxied.mode,
            "endpoint": proxied.endpoint,
            "model": call.sent.model,
            "upstream": call.sent.target.endpoint,
            "request": proxied.body,
            "response": data,
            "policy_version": call.sent.target.policy_version if version is None else version,
            "latency_s": time.monotonic() - call.started,
            "status_code": status_code,
        }
        if call.sent.policy is not None:  # several policies: which one this call trains
            record["policy"] = call.sent.policy
        if status_code == 200 and "error" not in data:
            record.update(extract_tokens(proxied.endpoint, data, spans))
            if spans:  # the version of the call's oldest token
                record["policy_version"] = min(choice[0][1] for choice in spans.values())
        try:
            await self.store.record_event(proxied.rollout_id, proxied.attempt_id, "model_request", record)
        except InvalidValue as exc:  # e.g. nested deeper than JSON is stored
            raise UpstreamError(502, f"the engine's answer cannot be recorded: {exc}") from None


@dataclass
class _Sent:
    """An engine's response, body unread, the endpoint that sent it, the model name it was
    asked for and the policy that name serves (None: the endpoint has one)."""

    target: ModelEndpoint
    response: UpstreamResponse
    model: str
    policy: str | None


@dataclass
class _Call:
    """What the record of one proxied call needs besides the answer."""

    proxied: ProxyCall
    sent: _Sent
    started: float


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
        forwarder: Forwarder,
        call: _Call,
        stack: AsyncExitStack,
        response: UpstreamResponse,
        version: int | None = None,
    ):
        self._forwarder = forwarder
        self._call = call
        self._stack = stack
        self._response = response
        self._version = version
        self._assembler = StreamAssembler(call.proxied.endpoint, version)
        self._arrived: list[bytes] = []  # fed to the assembler by `mark`, not yet relayed
        self._finished = False  # the engine's answer was read to its end
        self._recorded = False
        self._closed = False
        self.status = response.status

    async def read(self) -> tuple[bytes, dict[str, Any]]:
        raw = await _read_whole(self._response)
        self._finished = True
        raw, data = _parsed(raw)
        await self._record(data)
        return raw, data

    async def _record(self, data: dict[str, Any]) -> None:
        if not self._recorded:
            self._recorded = True
            spans = self._assembler.spans if self._version is not None else None
            await self._forwarder.record(self._call, self.status, data, self._version, spans)

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
            yield _sse_error(f"upstream failed mid-stream: {exc}")
        except UpstreamError as exc:  # the answer could not be recorded
            yield _sse_error(exc.reason)

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


def _sse_error(message: str) -> bytes:
    return b"data: " + codec.dumps({"error": {"message": message, "type": "upstream_error"}}) + b"\n\n"


async def _read_whole(response: UpstreamResponse) -> bytes:
    try:
        return await response.read()
    except UpstreamTimeout as exc:
        raise UpstreamError(504, f"upstream timed out: {exc}") from None
    except UpstreamIOError as exc:
        raise UpstreamError(502, f"upstream failed mid-answer: {exc}") from None


def _parsed(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    """The engine's body as the agent gets it, and parsed."""
    try:
        data = codec.loads(raw)
    except codec.JSONCodecError:
        # Python-made JSON may carry NaN (a logprob): the agent gets it as standard JSON
        # (NaN as null, as the event stores it), and anything else is the engine's fault.
        try:
            data = codec.loads_lenient(raw)
            raw = codec.dumps(data)
        except codec.JSONCodecError:
            raise UpstreamError(502, f"upstream returned non-JSON: {raw[:300].decode(errors='replace')}") from None
    if not isinstance(data, dict):
        raise UpstreamError(502, "upstream returned a JSON value that is not an object")
    return raw, data
