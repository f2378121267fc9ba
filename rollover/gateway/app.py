"""The gateway's route table: store REST API, recording proxy and pause/drain management in one
FastAPI app (its plumbing in `asgi`, key checks in `auth`, the relay back to agents in `relay`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import TypeAdapter, ValidationError
from starlette.routing import Route

from rollover import codec
from rollover.config import GatewaySettings
from rollover.gateway import auth
from rollover.gateway.admission import check_attempt, check_images, check_writer, enter, json_body, json_object
from rollover.gateway.apis import anthropic, responses
from rollover.gateway.asgi import (
    BodyLimitMiddleware,
    GatewayApp,
    answer_errors_as_json,
    error_response,
    json_response,
)
from rollover.gateway.calls import CALL_ID_HEADER, ProxyCall, UpstreamError
from rollover.gateway.images import ImageRefused
from rollover.gateway.proxy import ENDPOINTS
from rollover.gateway.relay import forward_unless_disconnected, relay_stream
from rollover.gateway.sampling import ForbiddenField, check_request
from rollover.gateway.state import GatewayState
from rollover.gateway.translated import (
    ANTHROPIC_COUNT_TOKENS_PATH,
    ANTHROPIC_MESSAGES_PATH,
    RESPONSES_PATH,
    TranslatedRoutes,
)
from rollover.store.models import (
    MAX_INT64,
    PROXY_EVENT_TYPES,
    EndpointPatch,
    Event,
    EventCreate,
    ModelEndpoint,
    PauseRequest,
    ProxyState,
    Rollout,
    RolloutCreate,
    RolloutState,
    StatusPatch,
    last_call_per_prompt,
    trimmed_for_training,
)
from rollover.store.rewards import call_key, call_rewards
from rollover.store.sqlite import RolloutStore

T = TypeVar("T")
PROXY_CALL_PATH = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/{endpoint:path}"
EVENTS_PATH = "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"


async def _json_body(request: Request) -> Any:
    return await json_body(request, request.app.state.gateway.settings.gateway.max_json_depth)


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


def without_engine_address(event: Event) -> Event:
    """An event as an agent may read it: a recorded call names no engine (engines are for the
    trainer and the gateway only; the admin key reads the whole record)."""
    if event.event_type != "model_request" or not isinstance(event.data, dict) or "upstream" not in event.data:
        return event
    return event.model_copy(update={"data": {k: v for k, v in event.data.items() if k != "upstream"}})


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
    admin_only = [Depends(auth.require_admin)]
    rollout_reader = [Depends(auth.require_rollout_access)]

    answer_errors_as_json(app)

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
        return json_response(await store.add_rollouts_json(items), 201)

    @app.get("/api/rollouts", dependencies=admin_only)
    async def list_rollouts(
        request: Request,
        state_in: list[RolloutState] | None = Query(None),
        rollout_id: list[str] | None = Query(None),
        limit: int | None = Query(None, ge=1, le=100000),
    ) -> Response:
        rollouts = await store.list_rollouts(state_in=state_in, rollout_ids=rollout_id, limit=limit)
        return json_response(_ROLLOUT_LIST.dump_json(rollouts))

    @app.get("/api/rollouts/terminal", dependencies=admin_only)
    async def list_terminal_rollouts(
        request: Request,
        after: int = Query(0, ge=0, le=MAX_INT64),  # an SQL OFFSET: SQLite's integers are 64-bit
        limit: int = Query(1000, ge=1, le=100000),
    ) -> Response:
        """Agent Lightning's cursor over finished rollouts ("terminal" is no rollout id)."""
        return json_response((await store.terminal_page(after, limit)).model_dump_json())

    @app.get("/api/rollouts/{rollout_id}", dependencies=rollout_reader)
    async def get_rollout(request: Request, rollout_id: str) -> Response:
        return json_response((await store.get_rollout(rollout_id)).model_dump_json())

    @app.patch("/api/rollouts/{rollout_id}", dependencies=admin_only)
    async def patch_rollout(request: Request, rollout_id: str) -> Response:
        body = await _parse(request, _STATUS_PATCH)
        return json_response((await store.update_status(rollout_id, body.status)).model_dump_json())

    @app.delete("/api/rollouts/{rollout_id}", dependencies=admin_only)
    async def delete_rollout(request: Request, rollout_id: str) -> dict[str, Any]:
        await store.delete_rollout(rollout_id)
        return {"deleted": rollout_id}

    async def add_event(request: Request) -> Response:
        rollout_id, attempt_id = request.path_params["rollout_id"], request.path_params["attempt_id"]
        auth.require_attempt_writer(request, rollout_id, attempt_id)
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
        if body.event_type == "reward" and isinstance(body.data, dict) and "call_id" in body.data:
            await _check_named_call(body.data["call_id"], rollout_id, attempt_id)
        event_id, created_at = await store.record_event(rollout_id, attempt_id, body.event_type, body.data)
        # As Event.model_dump_json writes it (tested), without building the model.
        event = {"event_id": event_id, "rollout_id": rollout_id, "attempt_id": attempt_id}
        event |= {"event_type": body.event_type, "data": body.data, "created_at": created_at, "timestamp": created_at}
        return json_response(codec.dumps(event), 201)

    async def _check_named_call(call_id: Any, rollout_id: str, attempt_id: str) -> None:
        """A reward for one turn names a call of its own attempt (`store.rewards`)."""
        if not isinstance(call_id, str) or not call_id:
            raise HTTPException(422, "data.call_id: the id of a recorded call (its X-Agl-Call-Id header)")
        owner = await store.call_owner(call_key(call_id))
        if owner is None:
            raise HTTPException(404, f"data.call_id: no call {call_id!r:.100} has been recorded")
        if owner != (rollout_id, attempt_id):
            raise HTTPException(403, f"data.call_id: call {call_id!r:.100} is not one of this attempt's")

    @app.get("/api/rollouts/{rollout_id}/events", dependencies=rollout_reader)
    async def list_events(
        request: Request,
        rollout_id: str,
        event_type: str | None = None,
        attempt_id: str | None = None,
        format: Literal["raw", "triplet", "samples"] = "raw",
    ) -> Response:
        if format == "samples":  # Rollover's view: per call token ids, logprobs, version; the reward
            return json_response((await store.triplets(rollout_id, attempt_id)).model_dump_json())
        events = await store.list_events(rollout_id, event_type=event_type or None, attempt_id=attempt_id)
        if not auth.is_admin(request):
            events = [without_engine_address(e) for e in events]
        if format == "triplet":  # Agent Lightning's: model requests (trimmed) and rewards
            relevant = [e for e in events if e.event_type in ("model_request", "reward")]
            rewards = call_rewards(relevant)
            kept = [trimmed_for_training(e, rewards.get(e.event_id)) for e in last_call_per_prompt(relevant)]
            return json_response(_JSON_LIST.dump_json(kept))
        return json_response(_EVENT_LIST.dump_json(events))

    @app.get("/api/images/{sha256}", dependencies=admin_only)
    async def get_image(request: Request, sha256: str) -> Response:
        """A recorded call's image by its content hash (`record["images"]`), as it was sent."""
        found = (await store.images([sha256])).get(sha256)
        if found is None:
            raise HTTPException(404, f"no image {sha256!r:.80} is stored")
        media_type, data = found
        return Response(data, media_type=media_type)

    # -- models ---------------------------------------------------------------------------

    @app.post("/api/models", status_code=201, dependencies=admin_only)
    async def register_models(request: Request) -> list[dict[str, Any]]:
        body = await _parse(request, _MODELS)
        state.forwarder.registered(state.registry.upsert(body if isinstance(body, list) else [body]))
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
        gone = [e.endpoint for e in state.registry.endpoints] if endpoint is None else [endpoint]
        if endpoint is None:
            state.registry.clear()
        else:
            state.registry.remove(endpoint)
        for url in gone:
            state.forwarder.boundaries.removed(url)
        await state.save_models()
        return [e.model_dump() for e in state.registry.endpoints]

    # -- pause / drain --------------------------------------------------------------------

    def with_counts(proxy_state: ProxyState) -> dict[str, Any]:
        """The pause state and partial rollout's counts (`Boundaries.counts`)."""
        counts = state.forwarder.boundaries.counts() | {"unhonoured_fields_total": dict(state.unhonoured)}
        return proxy_state.model_copy(update=counts).model_dump()

    @app.post("/proxy/pause", dependencies=admin_only)
    async def pause(request: Request) -> dict[str, Any]:
        body = await _parse(request, _PAUSE, empty=PauseRequest.model_validate({}))
        retry_after = state.retry_after_seconds if body.retry_after_seconds is None else body.retry_after_seconds
        paused = await state.pause.pause(body.reason, retry_after, body.expected_seconds)
        await state.save_pause()  # acknowledged once durable: a restarted gateway is still paused
        return with_counts(paused)

    @app.post("/proxy/resume", dependencies=admin_only)
    async def resume(request: Request) -> dict[str, Any]:
        resumed = await state.pause.resume()
        await state.save_pause()
        return with_counts(resumed)

    @app.get("/proxy/state", dependencies=admin_only)
    async def proxy_state(request: Request, wait_drained: float | None = Query(None, ge=0, le=3600)) -> dict[str, Any]:
        return with_counts(await state.pause.state(wait_drained))

    # -- the proxy ------------------------------------------------------------------------

    @app.get(
        "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/models", dependencies=rollout_reader
    )
    async def proxy_models(
        request: Request, rollout_id: str, attempt_id: str, mode: Literal["train", "val"]
    ) -> dict[str, Any]:
        # What an agent should ask for: the policies where the engines serve several, else
        # the model (which one an agent names does not matter then).
        names = sorted({name for e in state.registry.endpoints for name in (e.policies or [e.model])})
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "rollover"} for n in names]}

    async def proxy(request: Request) -> Response:
        params = request.path_params
        rollout_id, attempt_id, endpoint = (params[k] for k in ("rollout_id", "attempt_id", "endpoint"))
        mode = check_writer(request, rollout_id, attempt_id, params["mode"])
        if endpoint not in ENDPOINTS:
            served = ", ".join([*ENDPOINTS, "responses"])
            raise HTTPException(404, f"the proxy serves {served}, not {endpoint!r}")
        body = await json_object(request, settings.gateway.max_json_depth)
        try:
            check_request(body, endpoint, mode, state.settings.max_n)
        except ForbiddenField as exc:
            return error_response(400, "forbidden field", exc.reason)
        check_attempt(state, rollout_id, attempt_id)
        try:
            images = await check_images(state, rollout_id, body) if endpoint == "chat/completions" else None
        except ImageRefused as exc:
            return error_response(400, "bad request", str(exc))
        refused = await enter(state)
        if refused is not None:
            return JSONResponse({"error": "gateway paused", "reason": refused.reason}, 429, headers=refused.headers)
        call = ProxyCall(rollout_id, attempt_id, mode, endpoint, body, images=images)
        if body.get("stream") is True:
            return await relay_stream(state.forwarder, call, state.pause.leave)
        try:
            status_code, raw, _ = await forward_unless_disconnected(request, state.forwarder, call)
        except UpstreamError as exc:
            return error_response(exc.status_code, exc.error, exc.reason)
        finally:
            await state.pause.leave()
        return json_response(raw, status_code, {CALL_ID_HEADER: call.call_id})

    # The calls every agent makes skip FastAPI's middleware, router and per-request machinery
    # (parameter solving, response encoding): see GatewayApp. The app's exception handlers
    # still answer their errors.
    translated = TranslatedRoutes(state)
    hot = (
        (ANTHROPIC_COUNT_TOKENS_PATH, translated.anthropic_count_tokens, anthropic.error_body),
        (ANTHROPIC_MESSAGES_PATH, translated.anthropic_messages, anthropic.error_body),
        # before the chat route's path, which would match it
        (RESPONSES_PATH, translated.responses, responses.error_body),
        (PROXY_CALL_PATH, proxy, None),
        (EVENTS_PATH, add_event, None),
    )
    for path, endpoint, shape in hot:
        app.serve_first(path, endpoint, settings.gateway.max_body_bytes, shape=shape)
        app.router.routes.insert(0, Route(path, endpoint, methods=["POST"], include_in_schema=False))
    # The controller's batches of new rollouts too (the route above stays, for the schema).
    app.serve_first("/api/rollouts", create_rollouts, settings.gateway.max_body_bytes, check=auth.require_admin)
    return app
