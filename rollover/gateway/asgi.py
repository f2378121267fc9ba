"""The gateway's ASGI plumbing: the fast path for the calls every agent makes, the body limit,
and every error shaped as JSON `{"error", "reason"}`."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollover.store.errors import StoreError

log = logging.getLogger("rollover.gateway")
Endpoint = Callable[[Request], Awaitable[Response]]

ERROR_NAMES = {
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


def error_response(status_code: int, error: str, reason: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "reason": reason}, status_code=status_code, headers=headers)


def json_response(content: bytes | str, status_code: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """A JSON body already encoded (by pydantic or `codec`), sent without FastAPI re-encoding it."""
    return Response(content, status_code=status_code, media_type="application/json", headers=headers)


class _BodyTooLarge(Exception):
    pass


ErrorBody = Callable[[int, str], dict[str, Any]]  # an API's error shape: status, message -> body


class BodyLimitMiddleware:
    """Refuses bodies over the limit with 413 before a route parses them (in `shape`, an API's
    own error shape, when given)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, shape: ErrorBody | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.shape = shape

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
        reason = f"bodies are limited to {self.max_body_bytes} bytes (gateway.max_body_bytes)"
        if self.shape is not None:
            response = JSONResponse(self.shape(413, reason), status_code=413)
        else:
            response = error_response(413, "request too large", reason)
        await response(scope, receive, send)


class GatewayApp(FastAPI):
    """FastAPI, with the POSTs every agent makes (its model calls, its events: `hot`) served
    before FastAPI's middleware stack and router, which cost more than the rest of such a call
    (3 middlewares, route matching, a request and an exception context per layer): the path is
    matched here, the body limit applied, and an error answered by the app's own handlers. The
    routes are in the router too, which answers their other methods (405)."""

    hot: list[tuple[re.Pattern[str], ASGIApp]]  # its parameters are strings (no convertors)

    def serve_first(
        self,
        path: str,
        endpoint: Endpoint,
        max_body_bytes: int,
        check: Callable[[Request], None] | None = None,
        shape: ErrorBody | None = None,
    ) -> None:
        """POSTs to `path` go to `endpoint`, after `check` (a route's key check) if given; a body
        over the limit is refused in `shape` if given (an API's error shape)."""
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

        self.hot.append((pattern, BodyLimitMiddleware(serve, max_body_bytes, shape)))

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


def answer_errors_as_json(app: FastAPI) -> None:
    """Every error the app raises, the router's own 404 and 405 included, as `{"error", "reason"}`."""

    @app.exception_handler(StarletteHTTPException)  # the routes' and the router's own (404, 405)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = str(exc.detail)
        if type(exc) is StarletteHTTPException:  # the router's: no route, or not this method
            where = f"{request.method} {request.url.path}"
            allowed = (exc.headers or {}).get("Allow")
            reason = f"no endpoint {where} (allowed here: {allowed})" if allowed else f"no endpoint {where}"
        return error_response(exc.status_code, ERROR_NAMES.get(exc.status_code, "error"), reason, exc.headers)

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
        return error_response(exc.status_code, ERROR_NAMES.get(exc.status_code, "error"), str(exc))
