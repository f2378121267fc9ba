"""The recording OpenAI-compatible proxy and its pause/drain state."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from rollover import codec
from rollover.config import GatewaySettings
from rollover.gateway.streaming import StreamAssembler
from rollover.gateway.upstream import ConnectFailed, UpstreamIOError, UpstreamPool, UpstreamResponse, UpstreamTimeout
from rollover.retry import RetryPolicy, call_with_retries
from rollover.store.models import ModelEndpoint, ProxyState
from rollover.store.sqlite import InvalidValue, RolloutStore

Mode = Literal["train", "val"]
ENDPOINTS = ("chat/completions", "completions")
log = logging.getLogger("rollover.gateway.proxy")
RETRY_BACKOFF_SECONDS = 0.5  # first pause between upstream retries; doubles each retry


class ProxyPauseState:
    """`paused`, `inflight` and `reason`, guarded by one asyncio.Lock as in the seed."""

    def __init__(self, retry_after_seconds: float) -> None:
        self.paused = False
        self.reason: str | None = None
        self.retry_after_seconds = retry_after_seconds
        self.inflight = 0
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition(self._lock)
        self._paused_since: float | None = None
        self._paused_total = 0.0
        self._expected_end: float | None = None

    def _paused_seconds_total(self) -> float:
        running = time.monotonic() - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_total + running

    def _snapshot(self) -> ProxyState:
        return ProxyState(
            paused=self.paused,
            retry_after_seconds=self.retry_after_seconds,
            reason=self.reason,
            inflight=self.inflight,
            paused_seconds_total=round(self._paused_seconds_total(), 6),
        )

    async def pause(
        self, reason: str | None, retry_after_seconds: float, expected_seconds: float | None = None
    ) -> ProxyState:
        async with self._lock:
            if not self.paused:
                self._paused_since = time.monotonic()
            self.paused = True
            self.reason = reason
            self.retry_after_seconds = retry_after_seconds
            self._expected_end = None if expected_seconds is None else time.monotonic() + expected_seconds
            return self._snapshot()

    def retry_after(self) -> tuple[float, int | None]:
        """When a refused call should come back: Retry-After in seconds, and `retry-after-ms`
        (None when no length was announced: the seed's headers only). Never before the pause is
        expected to end (clients that come back early burn their retries), never sooner than
        the configured `retry_after_seconds`."""
        if self._expected_end is None:
            return self.retry_after_seconds, None
        left = self._expected_end - time.monotonic()
        seconds = max(self.retry_after_seconds, left)
        return float(math.ceil(seconds)) if left > self.retry_after_seconds else seconds, math.ceil(seconds * 1000)

    async def resume(self) -> ProxyState:
        async with self._changed:
            if self._paused_since is not None:
                self._paused_total += time.monotonic() - self._paused_since
                self._paused_since = None
            self.paused = False
            self.reason = None
            self._expected_end = None
            self._changed.notify_all()  # held calls go on
            return self._snapshot()

    async def state(self, wait_drained: float | None = None) -> ProxyState:
        async with self._changed:
            if wait_drained:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.inflight == 0), wait_drained)
                except asyncio.TimeoutError:
                    pass
            return self._snapshot()

    async def try_enter(self, hold_seconds: float = 0.0) -> tuple[ProxyState, tuple[float, int | None]] | None:
        """Count a new call in flight, or, while paused, wait up to `hold_seconds` for the
        resume (a held call is not in flight: the drain does not wait for it) and then return
        the state that refuses it and when to come back (`retry_after`)."""
        async with self._changed:
            if self.paused and hold_seconds > 0:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: not self.paused), hold_seconds)
                except asyncio.TimeoutError:
                    pass
            if self.paused:
                return self._snapshot(), self.retry_after()
            # Counted under the lock pause() takes: a pause that begins after this line waits
            # for the call to drain like any other.
            self.inflight += 1
            return None

    async def leave(self) -> None:
        async with self._changed:
            self.inflight -= 1
            self._changed.notify_all()

    def record(self) -> dict[str, Any]:
        """What a restarted gateway needs to go on pausing as this one did (`restore`): the
        flag, its reason and lengths, and the paused time so far; times as wall-clock times,
        which outlive the process (a monotonic clock does not)."""
        now, wall = time.monotonic(), time.time()
        return {
            "paused": self.paused,
            "reason": self.reason,
            "retry_after_seconds": self.retry_after_seconds,
            "paused_total": self._paused_total,
            "paused_since": None if self._paused_since is None else wall - (now - self._paused_since),
            "expected_end": None if self._expected_end is None else wall + (self._expected_end - now),
        }

    def restore(self, record: dict[str, Any]) -> None:
        """Take over a `record` saved by an earlier gateway on the same store. The time it was
        down while paused counts as paused: the agents could not call either."""
        now, wall = time.monotonic(), time.time()
        self.paused = bool(record.get("paused"))
        self.reason = record.get("reason")
        self.retry_after_seconds = float(record.get("retry_after_seconds", self.retry_after_seconds))
        self._paused_total = float(record.get("paused_total") or 0.0)
        since, end = record.get("paused_since"), record.get("expected_end")
        self._paused_since = None if since is None or not self.paused else now - max(0.0, wall - since)
        self._expected_end = None if end is None or not self.paused else now + (end - wall)


class _RetryableUpstream(Exception):
    """A failed engine call worth trying again: its status for the agent, and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Unreachable(_RetryableUpstream):
    """The engine could not be connected to: nothing listens there (it died, or is restarting)."""


class UpstreamError(Exception):
    def __init__(self, status_code: int, reason: str) -> None:
        super().__init__(reason)
        self.status_code = status_code
        self.reason = reason


_MASK64 = (1 << 64) - 1


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


@functools.lru_cache(maxsize=4096)
def _endpoint_seed(endpoint: str) -> int:
    return _hash64(endpoint)


def _weight(rollout_hash: int, endpoint: str) -> int:
    """An endpoint's weight for a rollout: splitmix64's finaliser over the two hashes (every
    input bit reaches every output bit), one sha1 per call instead of one per endpoint."""
    x = rollout_hash ^ _endpoint_seed(endpoint)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class ModelRegistry:
    """The inference endpoints, by URL. Entries are replaced, never changed in place: a caller
    holding one can tell whether it is still the registered one (`take_out`)."""

    endpoints: list[ModelEndpoint] = field(default_factory=list)

    def upsert(self, items: list[ModelEndpoint]) -> None:
        by_endpoint = {e.endpoint: e for e in self.endpoints}
        for item in items:
            by_endpoint[item.endpoint] = item
        self.endpoints = list(by_endpoint.values())

    def remove(self, endpoint: str) -> None:
        self.endpoints = [e for e in self.endpoints if e.endpoint != endpoint]

    def clear(self) -> None:
        self.endpoints = []

    def set_live(self, endpoint: str, live: bool) -> ModelEndpoint | None:
        """Put an endpoint in rotation or take it out; None if it is not registered."""
        for i, entry in enumerate(self.endpoints):
            if entry.endpoint == endpoint:
                if entry.live != live:
                    self.endpoints[i] = entry = entry.model_copy(update={"live": live})
                return entry
        return None

    def take_out(self, target: ModelEndpoint) -> bool:
        """Take `target` out of rotation if it is still the registered entry for its URL (an
        engine that registered again since is left alone) and another endpoint is live; True
        if it was."""
        if not target.live or not any(e.live and e is not target for e in self.endpoints):
            return False
        for i, entry in enumerate(self.endpoints):
            if entry is target:
                self.endpoints[i] = entry.model_copy(update={"live": False})
                return True
        return False

    def pick(self, rollout_id: str) -> ModelEndpoint | None:
        """Sticky per rollout (a multi-turn agent keeps hitting the same engine's prefix cache),
        by rendezvous hashing over the live endpoints: the one of highest weight for the rollout.
        An endpoint leaving moves only the rollouts it had; one joining takes ~1/N of them."""
        live = [e for e in self.endpoints if e.live]
        if len(live) <= 1:
            return live[0] if live else None
        rollout_hash = _hash64(rollout_id)
        return max(live, key=lambda e: _weight(rollout_hash, e.endpoint))


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
    upstream["stream"] = body.get("stream") is True
    if not upstream["stream"]:
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


def extract_tokens(endpoint: str, response: dict[str, Any]) -> dict[str, Any]:
    """Token ids and sampled-token logprobs of a vLLM response: its first choice's at the top
    level (as a call is recorded), and when it has several (`n` > 1) every choice's under
    `choices`, each becoming its own training sample."""
    choices = [c for c in response.get("choices") or [] if isinstance(c, dict)] or [{}]
    per_choice = [_choice_tokens(endpoint, response, choice) for choice in choices]
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

    async def _post_live(self, rollout_id: str, endpoint: str, body: dict[str, Any], mode: Mode) -> _Sent:
        """One try on the endpoint the rollout's hashing picks among the live ones. One that
        cannot be connected to (its engine is down) is taken out of rotation, persisted, and
        the call sent at once to the next pick: the other rollouts stay where they are. The
        last live one is not taken out: with nowhere to move the call, it is retried there
        (`_RetryableUpstream`) as with one engine. None live: `UpstreamError` 503."""
        payloads: dict[str, bytes] = {}
        last: _Unreachable | None = None
        # Bounded: each failed connect takes an endpoint out or finds it replaced.
        for _ in range(len(self.registry.endpoints) + 1):
            target = self.registry.pick(rollout_id)
            if target is None:
                if not self.registry.endpoints:
                    raise UpstreamError(503, "no inference endpoint registered (POST /api/models first)")
                raise UpstreamError(
                    503, f"no live inference endpoint ({len(self.registry.endpoints)} registered, all out of rotation)"
                )
            payload = payloads.get(target.model)
            if payload is None:
                payload = payloads[target.model] = codec.dumps(
                    prepare_request(body, endpoint, mode, target.model, self.settings)
                )
            try:
                return _Sent(target, await self._post(f"{target.endpoint.rstrip('/')}/{endpoint}", payload))
            except _Unreachable as exc:
                last = exc
                if self.registry.take_out(target):
                    log.warning("%s: taken out of rotation until it registers again", exc.reason)
                    if self.save_registry is not None:
                        await self.save_registry()
                elif self.registry.pick(rollout_id) is target:
                    raise  # the last live endpoint
        assert last is not None
        raise last

    async def _send_with_retries(self, rollout_id: str, endpoint: str, body: dict[str, Any], mode: Mode) -> _Sent:
        """`_post_live`, retried `gateway.upstream_retries` times. The first try goes without
        the retry machinery (27 us a call, measured): this is every agent call's path."""
        attempts = self.settings.gateway.upstream_retries + 1
        try:
            return await self._post_live(rollout_id, endpoint, body, mode)
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
                f"engine call for rollout {rollout_id}",
                lambda: self._post_live(rollout_id, endpoint, body, mode),
                policy,
                log,
            )
        except _RetryableUpstream as exc:
            raise UpstreamError(exc.status, f"{exc.reason} (after {attempts} attempts)") from None

    @asynccontextmanager
    async def open(self, rollout_id: str, endpoint: str, body: dict[str, Any], mode: Mode) -> AsyncIterator[_Sent]:
        """The endpoint that answered and its response, once its status says it will not be
        retried, body unread: a caller reads it whole (`forward`) or relays it as it streams.
        Leaving early (the agent hung up) closes the connection, which is how the engine
        learns to stop."""
        sent = await self._send_with_retries(rollout_id, endpoint, body, mode)
        try:
            yield sent
        except BaseException:
            sent.response.close()
            raise
        finally:
            sent.response.release()

    async def forward(
        self, rollout_id: str, attempt_id: str, mode: Mode, endpoint: str, body: dict[str, Any]
    ) -> tuple[int, bytes, dict[str, Any]]:
        """The engine's status, its body as sent, and that body parsed; the call is recorded."""
        started = time.monotonic()
        async with self.open(rollout_id, endpoint, body, mode) as sent:
            raw = await _read_whole(sent.response)
            status_code = sent.response.status
        raw, data = _parsed(raw)
        call = _Call(rollout_id, attempt_id, mode, endpoint, body, sent.target, started)
        await self.record(call, status_code, data)
        return status_code, raw, data

    async def stream(
        self, rollout_id: str, attempt_id: str, mode: Mode, endpoint: str, body: dict[str, Any]
    ) -> StreamedCall:
        """The engine's answer to a `stream: true` call, opened: see `StreamedCall`."""
        started = time.monotonic()
        stack = AsyncExitStack()
        sent = await stack.enter_async_context(self.open(rollout_id, endpoint, body, mode))
        call = _Call(rollout_id, attempt_id, mode, endpoint, body, sent.target, started)
        return StreamedCall(self, call, stack, sent.response)

    async def record(self, call: _Call, status_code: int, data: dict[str, Any]) -> None:
        record = {
            "mode": call.mode,
            "endpoint": call.endpoint,
            "model": call.target.model,
            "upstream": call.target.endpoint,
            "request": call.body,
            "response": data,
            "policy_version": call.target.policy_version,
            "latency_s": time.monotonic() - call.started,
            "status_code": status_code,
        }
        if status_code == 200 and "error" not in data:
            record.update(extract_tokens(call.endpoint, data))
        try:
            await self.store.record_event(call.rollout_id, call.attempt_id, "model_request", record)
        except InvalidValue as exc:  # e.g. nested deeper than JSON is stored
            raise UpstreamError(502, f"the engine's answer cannot be recorded: {exc}") from None


@dataclass
class _Sent:
    """An engine's response, body unread, and the endpoint that sent it."""

    target: ModelEndpoint
    response: UpstreamResponse


@dataclass
class _Call:
    """What the record of one proxied call needs besides the answer."""

    rollout_id: str
    attempt_id: str
    mode: Mode
    endpoint: str
    body: dict[str, Any]
    target: ModelEndpoint
    started: float


class StreamedCall:
    """A streamed engine answer, open: `status` as the engine answered; an error body is read
    whole (`read`), a 200 is relayed chunk by chunk (`chunks`) while a `StreamAssembler` puts
    the completion back together, recorded as one `model_request` like an unstreamed call just
    before the agent gets the stream's end (so the record is there before the agent can finish);
    a stream cut off is not recorded, as an unstreamed call cut off is not. `close` (always,
    once done) releases the engine's connection, or closes it if the stream did not reach its
    end, which is how the engine learns to stop generating."""

    def __init__(self, forwarder: Forwarder, call: _Call, stack: AsyncExitStack, response: UpstreamResponse):
        self._forwarder = forwarder
        self._call = call
        self._stack = stack
        self._response = response
        self._assembler = StreamAssembler(call.endpoint)
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
            await self._forwarder.record(self._call, self.status, data)

    async def chunks(self) -> AsyncIterator[bytes]:
        # Headers are sent: a failure is told in-band, as OpenAI's clients read it.
        try:
            async for piece in self._response.chunks():
                self._assembler.feed(piece)
                if self._assembler.done:
                    await self._record(self._assembler.response())
                yield piece
            self._finished = True
            await self._record(self._assembler.response())  # an engine that sent no [DONE]
        except UpstreamIOError as exc:
            yield _sse_error(f"upstream failed mid-stream: {exc}")
        except UpstreamError as exc:  # the answer could not be recorded
            yield _sse_error(exc.reason)

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
