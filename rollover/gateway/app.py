"""The gateway: store REST API, recording proxy and pause/drain management in one FastAPI app."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollover import codec
from rollover.config import GatewaySettings
from rollover.gateway import auth
from rollover.gateway.proxy import (
    ENDPOINTS,
    Forwarder,
    ModelRegistry,
    ProxyPauseState,
    StreamedCall,
    UpstreamError,
)
from rollover.store.models import (
    PROXY_EVENT_TYPES,
    EndpointPatch,
    Event,
    EventCreate,
    ModelEndpoint,
    PauseRequest,
    Rollout,
    RolloutCreate,
    RolloutState,
    StatusPatch,
    last_call_per_prompt,
    trimmed_for_training,
)
from rollover.store.sqlite import RolloutNotFound, RolloutStore, StoreError

T = TypeVar("T")
log = logging.getLogger("rollover.gateway")
PAUSE_STATE_KEY, MODELS_STATE_KEY = "pause", "models"  # rows of the store's gateway_state
PROXY_CALL_PATH = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/{endpoint:path}"
EVENTS_PATH = "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
DISCONNECT_CHECK_SECONDS = 0.5  # how often a proxied call still running checks that its agent is there
Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass
class GatewayState:
    """Everything the gateway holds; owned by the app (no module-level state)."""

    store: RolloutStore
    settings: GatewaySettings
    pause: ProxyPauseState = field(init=False)
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    forwarder: Forwarder = field(init=False)

    def __post_init__(self) -> None:
        if not self.settings.gateway.admin_key:
            raise ValueError("gateway.admin_key must be set to serve (generate one with auth.new_admin_key())")
        self.pause = ProxyPauseState(self.settings.gateway.retry_after_seconds)
        self.forwarder = Forwarder(self.store, self.registry, self.settings, self.save_models)
        # A gateway started on an existing store (a restart after a crash) comes back as the
        # last one left it: paused if it was, with the engines it knew.
        saved_pause = self.store.gateway_state(PAUSE_STATE_KEY)
        if isinstance(saved_pause, dict):
            self.pause.restore(saved_pause)
        saved_models = self.store.gateway_state(MODELS_STATE_KEY)
        if isinstance(saved_models, list):
            self.registry.upsert([ModelEndpoint.model_validate(m) for m in saved_models])

    async def save_pause(self) -> None:
        await self.store.save_gateway_state(PAUSE_STATE_KEY, self.pause.record())

    async def save_models(self) -> None:
        await self.store.save_gateway_state(MODELS_STATE_KEY, [e.model_dump() for e in self.registry.endpoints])

    @property
    def admin_key(self) -> str:
        key = self.settings.gateway.admin_key
        assert key is not None  # checked at construction
        return key

    @property
    def retry_after_seconds(self) -> float:
        return self.settings.gateway.retry_after_seconds


def error_response(status_code: int, error: str, reason: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "reason": reason}, status_code=status_code, headers=headers)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuses bodies over the limit with 413 before a route parses them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "request too large", f"bodies are limited to {self.max_body_bytes} bytes")
        await response(scope, receive, send)


class GatewayApp(FastAPI):
    """FastAPI, with the POSTs every agent makes (its model calls, its events: `hot`) served
    before FastAPI's middleware stack and router, which cost more than the rest of such a call
    (3 middlewares, route matching, a request and an exception context per layer): the path is
    matched here, the body limit applied, and an error answered by the app's own handlers. The
    routes are in the router too, which answers their other methods (405)."""

    hot: list[tuple[re.Pattern[str], ASGIApp]]  # its parameters are strings (no convertors)

    def serve_first(
        self, path: str, endpoint: Endpoint, max_body_bytes: int, check: Callable[[Request], None] | None = None
    ) -> None:
        """POSTs to `path` go to `endpoint`, after `check` (a route's key check) if given."""
        pattern, _, _ = compile_path(path)

        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            request = Request(scope, receive)
            try:
                if check is not None:
                    check(request)
                response = await endpoint(request)
            except _BodyTooLarge:
                raise  # answered by the body limit
            except Exception as exc:
                response = await self._answer_error(request, exc)
            await response(scope, receive, send)

        self.hot.append((pattern, BodyLimitMiddleware(serve, max_body_bytes)))

    async def _answer_error(self, request: Request, exc: Exception) -> Response:
        handler = next(h for h in map(self.exception_handlers.get, type(exc).__mro__) if h is not None)
        if handler is self.exception_handlers.get(Exception):
            log.error("error in %s %s", request.method, request.url.path, exc_info=exc)
        answer = handler(request, exc)
        response = await answer if inspect.isawaitable(answer) else answer
        assert isinstance(response, Response)
        return response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            for pattern, serve in self.hot:
                match = pattern.match(scope["path"])
                if match is not None:
                    scope["app"] = self
                    scope["path_params"] = match.groupdict()
                    await serve(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)


# Keys are checked first, before the body or the query is looked at: FastAPI routes take the
# checks below as dependencies, which it runs before it validates their parameters.


def _require_admin(request: Request) -> None:
    state: GatewayState = request.app.state.gateway
    key = auth.presented_key(request)
    if not auth.is_admin(state.admin_key, key):
        _refuse_key(key, "this endpoint needs the admin key")


def _require_rollout_access(request: Request) -> None:
    """Reading a rollout: the admin key, or the scoped key of any of its attempts."""
    state: GatewayState = request.app.state.gateway
    rollout_id = request.path_params["rollout_id"]
    key = auth.presented_key(request)
    if auth.is_admin(state.admin_key, key):
        return
    try:
        attempts = state.store.snapshot(rollout_id).attempts
    except RolloutNotFound:
        attempts = ()
    if auth.scoped_attempt(state.admin_key, key, rollout_id, attempts) is None:
        _refuse_key(key, f"the key is not valid for rollout {rollout_id}")


def _require_attempt_writer(request: Request, rollout_id: str, attempt_id: str) -> None:
    """Writing into an attempt (events, proxy calls): the admin key, or the attempt's own
    scoped key while that attempt is the rollout's running one."""
    state: GatewayState = request.app.state.gateway
    key = auth.presented_key(request)
    if auth.is_admin(state.admin_key, key):
        return
    if not auth.is_attempt_key(state.admin_key, key, rollout_id, attempt_id):
        _refuse_key(key, f"the key is not valid for attempt {attempt_id} of rollout {rollout_id}")
    rollout = state.store.snapshot(rollout_id)
    if rollout.state != RolloutState.RUNNING or rollout.last_attempt_id != attempt_id:
        now = (
            f"running attempt {rollout.last_attempt_id}"
            if rollout.state == RolloutState.RUNNING
            else rollout.state.value
        )
        raise HTTPException(
            409, f"attempt {attempt_id} of rollout {rollout_id} is over (the rollout is {now}): its key writes no more"
        )


def _refuse_key(key: str | None, reason: str) -> None:
    if key is None:
        raise HTTPException(401, "missing key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    if key.startswith(auth.SCOPED_PREFIX):
        raise HTTPException(403, reason)
    raise HTTPException(401, "invalid key")


async def _json_body(request: Request) -> Any:
    """The body as JSON whatever the Content-Type says (agents and curl are not always careful)."""
    raw = await request.body()
    depth = request.app.state.gateway.settings.gateway.max_json_depth
    try:
        return codec.loads(raw, max_depth=depth)
    except codec.JSONCodecError as exc:
        raise HTTPException(
            400,
            f"body refused: {exc}. Send standard JSON: no NaN or Infinity, no lone surrogates,"
            f" at most {depth} levels deep (gateway.max_json_depth)",
        ) from None


async def _json_object(request: Request) -> dict[str, Any]:
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise HTTPException(400, "body must be a JSON object")
    return body


async def _parse(request: Request, adapter: TypeAdapter[T], empty: T | None = None) -> T:
    if empty is not None and not (await request.body()).strip():
        return empty
    try:
        return adapter.validate_python(await _json_body(request))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


_ROLLOUTS = TypeAdapter(list[RolloutCreate] | RolloutCreate)
_STATUS_PATCH = TypeAdapter(StatusPatch)
_EVENT = TypeAdapter(EventCreate)
_MODELS = TypeAdapter(list[ModelEndpoint] | ModelEndpoint)
_ENDPOINT_PATCH = TypeAdapter(EndpointPatch)
_PAUSE = TypeAdapter(PauseRequest)
_ROLLOUT_LIST = TypeAdapter(list[Rollout])
_EVENT_LIST = TypeAdapter(list[Event])
_JSON_LIST = TypeAdapter(list[dict[str, Any]])


def _json(content: bytes | str, status_code: int = 200) -> Response:
    """A JSON body already encoded (by pydantic or `codec`), sent without FastAPI re-encoding it."""
    return Response(content, status_code=status_code, media_type="application/json")


def create_app(store: RolloutStore, settings: GatewaySettings, *, close_store: bool = False) -> FastAPI:
    """The gateway over `store`, configured by `settings` (its `gateway.admin_key` must be set)."""
    state = GatewayState(store=store, settings=settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.forwarder.aclose()
        if close_store:
            store.close()

    # The schema and its pages are served below, behind the admin key like everything but /healthz.
    app = GatewayApp(title="Rollover gateway", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.hot = []
    app.state.gateway = state
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.gateway.max_body_bytes)
    admin_only = [Depends(_require_admin)]
    rollout_reader = [Depends(_require_rollout_access)]

    @app.exception_handler(StarletteHTTPException)  # the routes' and the router's own (404, 405)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = str(exc.detail)
        if type(exc) is StarletteHTTPException:  # the router's: no route, or not this method
            where = f"{request.method} {request.url.path}"
            allowed = (exc.headers or {}).get("Allow")
            reason = f"no endpoint {where} (allowed here: {allowed})" if allowed else f"no endpoint {where}"
        return error_response(exc.status_code, _ERROR_NAMES.get(exc.status_code, "error"), reason, exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets the gateway's error shape.
        return error_response(500, "internal error", f"{type(exc).__name__}: {exc} (see the gateway's log)")

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        reasons = []
        for error in exc.errors():
            where, message = ".".join(str(p) for p in error["loc"]), str(error["msg"]).removeprefix("Value error, ")
            reasons.append(f"{where}: {message}" if where else message)
        return error_response(422, "invalid request", "; ".join(reasons))

    @app.exception_handler(StoreError)
    async def on_store_error(request: Request, exc: StoreError) -> JSONResponse:
        return error_response(exc.status_code, _ERROR_NAMES.get(exc.status_code, "error"), str(exc))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        # The instance token lets a launcher tell its own server from another that took the port.
        return {"status": "ok", "instance": settings.instance}

    @app.get("/openapi.json", include_in_schema=False, dependencies=admin_only)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=admin_only)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Rollover gateway")

    @app.get("/redoc", include_in_schema=False, dependencies=admin_only)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="Rollover gateway")

    # -- store ----------------------------------------------------------------------------

    @app.post("/api/rollouts", status_code=201, dependencies=admin_only)
    async def create_rollouts(request: Request) -> Response:
        body = await _parse(request, _ROLLOUTS)
        items = body if isinstance(body, list) else [body]
        return _json(await store.add_rollouts_json(items), 201)

    @app.get("/api/rollouts", dependencies=admin_only)
    async def list_rollouts(
        request: Request,
        state_in: list[RolloutState] | None = Query(None),
        rollout_id: list[str] | None = Query(None),
        limit: int | None = Query(None, ge=1, le=100000),
    ) -> Response:
        rollouts = await store.list_rollouts(state_in=state_in, rollout_ids=rollout_id, limit=limit)
        return _json(_ROLLOUT_LIST.dump_json(rollouts))

    @app.get("/api/rollouts/terminal", dependencies=admin_only)
    async def list_terminal_rollouts(
        request: Request, after: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=100000)
    ) -> Response:
        """Agent Lightning's cursor over finished rollouts ("terminal" is no rollout id)."""
        return _json((await store.terminal_page(after, limit)).model_dump_json())

    @app.get("/api/rollouts/{rollout_id}", dependencies=rollout_reader)
    async def get_rollout(request: Request, rollout_id: str) -> Response:
        return _json((await store.get_rollout(rollout_id)).model_dump_json())

    @app.patch("/api/rollouts/{rollout_id}", dependencies=admin_only)
    async def patch_rollout(request: Request, rollout_id: str) -> Response:
        body = await _parse(request, _STATUS_PATCH)
        return _json((await store.update_status(rollout_id, body.status)).model_dump_json())

    @app.delete("/api/rollouts/{rollout_id}", dependencies=admin_only)
    async def delete_rollout(request: Request, rollout_id: str) -> dict[str, Any]:
        await store.delete_rollout(rollout_id)
        return {"deleted": rollout_id}

    async def add_event(request: Request) -> Response:
        rollout_id, attempt_id = request.path_params["rollout_id"], request.path_params["attempt_id"]
        _require_attempt_writer(request, rollout_id, attempt_id)
        body = await _parse(request, _EVENT)
        if body.event_type in PROXY_EVENT_TYPES:
            # They are the recorded calls whose token ids and logprobs training reads: only the
            # proxy writes them, with any key (nothing in Rollover posts them; a forged one
            # would reach training).
            raise HTTPException(
                403,
                f"{body.event_type!r} events are written only by the gateway's proxy: make the model call"
                " through /proxy/rollout/.../openai/v1 and post events of your own types",
            )
        event_id, created_at = await store.record_event(rollout_id, attempt_id, body.event_type, body.data)
        # As Event.model_dump_json writes it (tested), without building the model.
        event = {"event_id": event_id, "rollout_id": rollout_id, "attempt_id": attempt_id}
        event |= {"event_type": body.event_type, "data": body.data, "created_at": created_at, "timestamp": created_at}
        return _json(codec.dumps(event), 201)

    @app.get("/api/rollouts/{rollout_id}/events", dependencies=rollout_reader)
    async def list_events(
        request: Request,
        rollout_id: str,
        event_type: str | None = None,
        attempt_id: str | None = None,
        format: Literal["raw", "triplet", "samples"] = "raw",
    ) -> Response:
        if format == "samples":  # Rollover's view: per call token ids, logprobs, version; the reward
            return _json((await store.triplets(rollout_id, attempt_id)).model_dump_json())
        events = await store.list_events(rollout_id, event_type=event_type or None, attempt_id=attempt_id)
        if format == "triplet":  # Agent Lightning's: model requests (trimmed) and rewards
            relevant = [e for e in events if e.event_type in ("model_request", "reward")]
            kept = [trimmed_for_training(e) for e in last_call_per_prompt(relevant)]
            return _json(_JSON_LIST.dump_json(kept))
        return _json(_EVENT_LIST.dump_json(events))

    # -- models ---------------------------------------------------------------------------

    @app.post("/api/models", status_code=201, dependencies=admin_only)
    async def register_models(request: Request) -> list[dict[str, Any]]:
        body = await _parse(request, _MODELS)
        state.registry.upsert(body if isinstance(body, list) else [body])
        await state.save_models()
        return [e.model_dump() for e in state.registry.endpoints]

    @app.get("/api/models", dependencies=admin_only)
    async def list_models(request: Request) -> list[dict[str, Any]]:
        return [e.model_dump() for e in state.registry.endpoints]

    @app.patch("/api/models", dependencies=admin_only)
    async def patch_model(request: Request, endpoint: str = Query(min_length=1)) -> dict[str, Any]:
        """`{"live": false}` takes a registered endpoint out of rotation, `true` puts it back."""
        body = await _parse(request, _ENDPOINT_PATCH)
        entry = state.registry.set_live(endpoint, body.live)
        if entry is None:
            raise HTTPException(404, f"no inference endpoint {endpoint!r} is registered")
        await state.save_models()
        return entry.model_dump()

    @app.delete("/api/models", dependencies=admin_only)
    async def delete_models(request: Request, endpoint: str | None = Query(None, min_length=1)) -> list[dict[str, Any]]:
        """All endpoints, or with `?endpoint=URL` that one (none such: nothing to do)."""
        if endpoint is None:
            state.registry.clear()
        else:
            state.registry.remove(endpoint)
        await state.save_models()
        return [e.model_dump() for e in state.registry.endpoints]

    # -- pause / drain --------------------------------------------------------------------

    @app.post("/proxy/pause", dependencies=admin_only)
    async def pause(request: Request) -> dict[str, Any]:
        body = await _parse(request, _PAUSE, empty=PauseRequest.model_validate({}))
        retry_after = state.retry_after_seconds if body.retry_after_seconds is None else body.retry_after_seconds
        paused = await state.pause.pause(body.reason, retry_after, body.expected_seconds)
        await state.save_pause()  # acknowledged once durable: a restarted gateway is still paused
        return paused.model_dump()

    @app.post("/proxy/resume", dependencies=admin_only)
    async def resume(request: Request) -> dict[str, Any]:
        resumed = await state.pause.resume()
        await state.save_pause()
        return resumed.model_dump()

    @app.get("/proxy/state", dependencies=admin_only)
    async def proxy_state(request: Request, wait_drained: float | None = Query(None, ge=0, le=3600)) -> dict[str, Any]:
        return (await state.pause.state(wait_drained)).model_dump()

    # -- the proxy ------------------------------------------------------------------------

    @app.get(
        "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/models", dependencies=rollout_reader
    )
    async def proxy_models(
        request: Request, rollout_id: str, attempt_id: str, mode: Literal["train", "val"]
    ) -> dict[str, Any]:
        names = sorted({e.model for e in state.registry.endpoints})
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "rollover"} for n in names]}

    async def proxy(request: Request) -> Response:
        params = request.path_params
        rollout_id, attempt_id, mode, endpoint = (params[k] for k in ("rollout_id", "attempt_id", "mode", "endpoint"))
        _require_attempt_writer(request, rollout_id, attempt_id)
        if mode not in ("train", "val"):
            raise RequestValidationError([{"loc": ("path", "mode"), "msg": "Input should be 'train' or 'val'"}])
        if endpoint not in ENDPOINTS:
            raise HTTPException(404, f"the proxy serves {', '.join(ENDPOINTS)}, not {endpoint!r}")
        body = await _json_object(request)
        rollout = store.snapshot(rollout_id)  # in memory: no round trip to the store thread
        if rollout.state.terminal:
            raise HTTPException(409, f"rollout {rollout_id} is already {rollout.state.value}")
        if attempt_id not in rollout.attempts:
            raise HTTPException(404, f"rollout {rollout_id} has no attempt {attempt_id}")
        gateway = state.settings.gateway
        refused = await state.pause.try_enter(gateway.max_hold_seconds if gateway.hold_while_paused else 0.0)
        if refused is not None:
            paused, (seconds, retry_after_ms) = refused
            headers = {
                "Retry-After": str(int(seconds)) if float(seconds).is_integer() else str(seconds),
                "X-Agl-Paused": "true",
            }
            if retry_after_ms is not None:
                headers["retry-after-ms"] = str(retry_after_ms)
            return JSONResponse({"error": "gateway paused", "reason": paused.reason}, status_code=429, headers=headers)
        if body.get("stream") is True:
            return await _open_stream(state, rollout_id, attempt_id, mode, endpoint, body)
        try:
            status_code, raw, _ = await _forward_unless_disconnected(
                request, state, rollout_id, attempt_id, mode, endpoint, body
            )
        except UpstreamError as exc:
            return error_response(exc.status_code, "upstream error", exc.reason)
        finally:
            await state.pause.leave()
        return _json(raw, status_code)

    # The calls every agent makes skip FastAPI's middleware, router and per-request machinery
    # (parameter solving, response encoding): see GatewayApp. The app's exception handlers
    # still answer their errors.
    for path, endpoint in ((PROXY_CALL_PATH, proxy), (EVENTS_PATH, add_event)):
        app.serve_first(path, endpoint, settings.gateway.max_body_bytes)
        app.router.routes.insert(0, Route(path, endpoint, methods=["POST"], include_in_schema=False))
    # The controller's batches of new rollouts too (the route above stays, for the schema).
    app.serve_first("/api/rollouts", create_rollouts, settings.gateway.max_body_bytes, check=_require_admin)
    return app


class _RelayedStream(StreamingResponse):
    """The engine's chunks, relayed as they arrive; whatever ends the response (the last chunk,
    the agent hanging up, an error) closes the engine call and then counts the call out."""

    def __init__(self, call: StreamedCall, leave: Callable[[], Awaitable[None]]) -> None:
        super().__init__(call.chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
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


async def _open_stream(
    state: GatewayState,
    rollout_id: str,
    attempt_id: str,
    mode: Literal["train", "val"],
    endpoint: str,
    body: dict[str, Any],
) -> Response:
    """A `stream: true` call (counted in flight by the caller): relayed, or the engine's error."""
    try:
        call = await state.forwarder.stream(rollout_id, attempt_id, mode, endpoint, body)
    except UpstreamError as exc:
        await state.pause.leave()
        return error_response(exc.status_code, "upstream error", exc.reason)
    except BaseException:
        await state.pause.leave()
        raise
    if call.status == 200:
        return _RelayedStream(call, state.pause.leave)
    try:
        raw, _ = await call.read()
    except UpstreamError as exc:
        return error_response(exc.status_code, "upstream error", exc.reason)
    finally:
        try:
            await call.close()
        finally:
            await state.pause.leave()
    return _json(raw, call.status)


async def _forward_unless_disconnected(
    request: Request,
    state: GatewayState,
    rollout_id: str,
    attempt_id: str,
    mode: Literal["train", "val"],
    endpoint: str,
    body: dict[str, Any],
) -> tuple[int, bytes, dict[str, Any]]:
    """Forward the call; if the agent hangs up first, cancel it so the engine stops generating.

    The call runs in the request's own task: a watcher for the agent hanging up is started only
    once it has taken `DISCONNECT_CHECK_SECONDS`, so the usual short call pays for a timer, not
    for a task of its own and the turns of the event loop that hand its result back."""
    call = asyncio.current_task()
    assert call is not None  # a request is served in a task
    hung_up = asyncio.Event()
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_CHECK_SECONDS)
        hung_up.set()
        call.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = asyncio.create_task(watch())

    timer = asyncio.get_running_loop().call_later(DISCONNECT_CHECK_SECONDS, start_watching)
    try:
        return await state.forwarder.forward(rollout_id, attempt_id, mode, endpoint, body)
    except asyncio.CancelledError:
        if not hung_up.is_set():
            raise  # cancelled from outside (the server shutting down)
        if sys.version_info >= (3, 11):
            call.uncancel()  # a cancel caught and turned into an answer: later awaits are not cancelled
        raise UpstreamError(499, "client disconnected; upstream call cancelled") from None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


_ERROR_NAMES = {
    400: "bad request",
    401: "unauthorized",
    403: "forbidden",
    404: "not found",
    409: "conflict",
    413: "request too large",
    422: "invalid request",
    405: "method not allowed",
    429: "gateway paused",
    502: "upstream error",
    500: "internal error",
    503: "upstream unavailable",
}
