"""`rollover view RUN_DIR`: a small read-only web app over a run folder.

The page (plain JS, inline SVG charts, shipped in `static/`: no build step, no CDN) polls a
JSON API. It binds to 127.0.0.1 by default and always requires a key (the given one, or one
generated and printed in its URL), given as `?key=` once (then kept in a cookie) or as
`Authorization: Bearer` / `x-api-key`: any local process, an agent included, can reach
loopback. It answers only requests whose `Host` is a loopback name or one it was told to
accept (`--allow-host`), so a web page elsewhere cannot reach it through DNS rebinding.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollover.store import StoreError
from rollover.viewer.data import RolloutFilter, RunFolder, RunFolderError

STATIC = Path(__file__).parent / "static"
COOKIE = "rollover_view_key"
_STATES = ("queuing", "running", "succeeded", "failed", "aborted")


def _error(status_code: int, error: str, reason: str) -> JSONResponse:
    return JSONResponse({"error": error, "reason": reason}, status_code=status_code)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def access_key(key: str | None) -> str:
    """The key to require: the given one, else a new one (a run's prompts are never served
    unguarded, not even on loopback, which every local process can reach)."""
    return key or "vk-" + secrets.token_urlsafe(18)


def host_name(header: str) -> str:
    """The host of a `Host` header, without its port (and an IPv6 address without brackets)."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def build_app(run: RunFolder, key: str, allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        yield
        run.close()

    app = FastAPI(title="Rollover run viewer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    allowed = {h.lower() for h in allowed_hosts}

    @app.middleware("http")
    async def require_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        host = host_name(request.headers.get("host", "")).lower()
        if not (is_loopback(host) or host in allowed):
            return _error(
                421, "unknown host", f"this viewer answers loopback names only, not {host!r} (see --allow-host)"
            )
        if request.url.path == "/healthz":
            return await call_next(request)
        given = request.query_params.get("key") or request.cookies.get(COOKIE) or _header_key(request)
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            return _error(401, "unauthorized", "this viewer needs its key: open the URL it printed")
        if "key" in request.query_params:  # keep it in a cookie and drop it from the address bar
            response: Response = RedirectResponse(request.url.remove_query_params("key"), status_code=303)
            response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
            return response
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's, and the router's own 404/405
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "error", str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        reasons = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return _error(422, "invalid request", "; ".join(reasons))

    @app.exception_handler(StoreError)
    async def on_store_error(request: Request, exc: StoreError) -> JSONResponse:
        return _error(exc.status_code, "not found" if exc.status_code == 404 else "store error", str(exc))

    @app.exception_handler(RunFolderError)
    async def on_run_error(request: Request, exc: RunFolderError) -> JSONResponse:
        return _error(404, "not found", str(exc))

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name}")
    async def static(name: str) -> FileResponse:
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise HTTPException(404, f"no static file {name}")
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/run")
    async def summary() -> dict[str, Any]:
        return run.summary()

    @app.get("/api/metrics")
    async def metrics(since: int = Query(0, ge=0, description="rows already held by the page")) -> dict[str, Any]:
        rows = run.metrics()
        return {"total": len(rows), "rows": rows[since:]}

    @app.get("/api/timeline")
    async def timeline() -> dict[str, Any]:
        return await run.timeline()

    @app.get("/api/rollouts")
    async def rollouts(
        step: int | None = Query(None, ge=0),
        state: str | None = Query(None),
        mode: str | None = Query(None, pattern="^(train|val)$"),
        group: str | None = Query(None, max_length=500),
        reward_min: float | None = Query(None),
        reward_max: float | None = Query(None),
        limit: int = Query(200, ge=1, le=5000),
        offset: int = Query(0, ge=0),
    ) -> dict[str, Any]:
        if state is not None and state not in _STATES:
            raise HTTPException(422, f"state must be one of {', '.join(_STATES)}")
        keep = RolloutFilter(
            step=step, state=state, mode=mode, group=group or None, reward_min=reward_min, reward_max=reward_max
        )
        rows = await run.rollouts(keep)
        return {"total": len(rows), "offset": offset, "rollouts": rows[offset : offset + limit]}

    @app.get("/api/groups/{group}")
    async def group(group: str) -> dict[str, Any]:
        rows = await run.group(group)
        if not rows:
            raise HTTPException(404, f"no rollouts in group {group}")
        return {"group": group, "rollouts": rows}

    @app.get("/api/rollouts/{rollout_id}")
    async def rollout(rollout_id: str) -> dict[str, Any]:
        return await run.rollout(rollout_id)

    @app.get("/api/images/{sha256}")
    async def image(sha256: str) -> Response:
        """A call's image as recorded (the gateway took only PNG, JPEG, GIF and WEBP)."""
        found = await run.image(sha256)
        if found is None:
            raise HTTPException(404, f"no image {sha256:.80}")
        media_type, data = found
        return Response(data, media_type=media_type, headers={"Cache-Control": "max-age=86400, immutable"})

    return app


def _header_key(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


class ViewerThread:
    """The viewer on a background thread of this process (tests, the overhead benchmark)."""

    def __init__(self, run: RunFolder, key: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from rollover.processes import free_port

        self.host, self.port = host, port or free_port(host)
        self.key = access_key(key)
        config = uvicorn.Config(build_app(run, self.key), host=host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="rollover-viewer", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    @property
    def headers(self) -> dict[str, str]:
        """What a client sends to be let in."""
        return {"x-api-key": self.key}

    @property
    def landing_url(self) -> str:
        """The URL a browser opens once: the key then lives in a cookie."""
        return f"{self.url}?key={self.key}"

    def __enter__(self) -> ViewerThread:
        import httpx

        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"viewer at {self.url} did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


def _warm_imports() -> None:
    import rollover.training.advantages
    import rollover.training.manager
    import rollover.training.samples  # noqa: F401


def serve(
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    key: str | None = None,
    tokenizer: str | Path | None = None,
    log_level: str = "warning",
    allowed_hosts: tuple[str, ...] = (),
) -> None:
    import uvicorn

    run = RunFolder(run_dir, tokenizer)
    key = access_key(key)
    if host not in ("0.0.0.0", "::"):
        allowed_hosts = (*allowed_hosts, host)  # the address it was bound to, asked for by name
    # torch (the trainer's advantages and samples) takes seconds to import: not on the first click
    threading.Thread(target=_warm_imports, name="viewer-imports", daemon=True).start()
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
    print(f"viewing {run.run_dir} at {url}?key={key}", flush=True)
    uvicorn.run(build_app(run, key, allowed_hosts), host=host, port=port, log_level=log_level)
