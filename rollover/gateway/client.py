"""Async client of the gateway's REST API, used by the trainer, the controller and the engine."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal

import httpx

from rollover.endpoints import client_tls
from rollover.gateway.keys import scoped_key
from rollover.retry import RetryPolicy, call_with_retries
from rollover.store.models import (
    Event,
    ModelEndpoint,
    ProxyState,
    Rollout,
    RolloutCreate,
    RolloutState,
    TripletBundle,
)

log = logging.getLogger("rollover.gateway.client")

# Requests that are safe to send twice: one cut off mid-answer (the gateway died after reading
# it) is retried too. Others are retried only when they never reached the gateway.
_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE"})
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
_CUT_OFF = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class GatewayError(Exception):
    def __init__(self, status_code: int, reason: str) -> None:
        super().__init__(f"gateway answered {status_code}: {reason}")
        self.status_code = status_code
        self.reason = reason


class ConflictError(GatewayError):
    """HTTP 409: an illegal state transition, e.g. claiming a rollout someone else claimed."""


class NotFoundError(GatewayError):
    pass


def is_transient(exc: BaseException) -> bool:
    """A gateway error worth retrying: it is restarting or unreachable (transport errors),
    failing inside (5xx) or shedding load (429)."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, GatewayError) and (exc.status_code >= 500 or exc.status_code == 429)


class GatewayClient:
    """`retry_seconds`: how long a call keeps retrying a gateway it cannot reach (a restart
    takes seconds), with backoff; then the transport error is raised. 0 = no retries."""

    def __init__(self, base_url: str, admin_key: str, *, timeout: float = 30.0, retry_seconds: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.retry_seconds = retry_seconds
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=64),
            verify=client_tls(),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, idempotent: bool | None, **kwargs: Any) -> httpx.Response:
        retry_cut_off = method in _IDEMPOTENT_METHODS if idempotent is None else idempotent

        def unreachable(exc: BaseException) -> bool:
            # `retry_seconds` read at each failure: set to 0, calls already retrying stop too.
            if self.retry_seconds <= 0:
                return False
            return isinstance(exc, _NEVER_SENT) or (retry_cut_off and isinstance(exc, _CUT_OFF))

        if self.retry_seconds <= 0:
            return await self._http.request(method, path, **kwargs)
        policy = RetryPolicy(transient=unreachable, give_up_after=self.retry_seconds, first_wait=0.1, max_wait=2.0)
        return await call_with_retries(
            f"{method} {self.base_url}{path}", lambda: self._http.request(method, path, **kwargs), policy, log
        )

    async def _request(self, method: str, path: str, *, idempotent: bool | None = None, **kwargs: Any) -> Any:
        """One API call, retried while the gateway is unreachable (see `retry_seconds`).
        `idempotent`: whether sending it twice is harmless (default: by its method)."""
        response = await self._send(method, path, idempotent, **kwargs)
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = None
            # Not every server in front of a gateway answers the gateway's error shape.
            reason = str(body.get("reason", response.text)) if isinstance(body, dict) else response.text
            error = {409: ConflictError, 404: NotFoundError}.get(response.status_code, GatewayError)
            raise error(response.status_code, reason)
        return response.json()

    # -- agent-facing URLs ----------------------------------------------------------------

    def proxy_base_url(self, rollout_id: str, attempt_id: str, mode: Literal["train", "val"] = "train") -> str:
        return f"{self.base_url}/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1"

    def event_url(self, rollout_id: str, attempt_id: str) -> str:
        return f"{self.base_url}/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"

    def scoped_key(self, rollout_id: str, attempt_id: str) -> str:
        """The key of one attempt: it opens that attempt's proxy path and events only."""
        return scoped_key(self.admin_key, rollout_id, attempt_id)

    # -- store ----------------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            return (await self._http.get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    async def enqueue(self, rollouts: Iterable[RolloutCreate | dict[str, Any]]) -> list[Rollout]:
        body = [r.model_dump(mode="json", exclude_none=True) if isinstance(r, RolloutCreate) else r for r in rollouts]
        # Caller-chosen ids make the POST idempotent (an existing rollout is kept as is).
        idempotent = all(r.get("rollout_id") for r in body)
        return [
            Rollout.model_validate(r)
            for r in await self._request("POST", "/api/rollouts", json=body, idempotent=idempotent)
        ]

    async def image(self, sha256: str) -> bytes:
        """A recorded call's image by its content hash, as the agent sent it."""
        response = await self._send("GET", f"/api/images/{sha256}", None)
        if response.status_code >= 400:
            error = NotFoundError if response.status_code == 404 else GatewayError
            raise error(response.status_code, response.text[:300])
        return response.content

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return Rollout.model_validate(await self._request("GET", f"/api/rollouts/{rollout_id}"))

    async def list_rollouts(
        self,
        state_in: Iterable[RolloutState | str] | None = None,
        rollout_ids: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        states = [RolloutState(s).value for s in state_in or ()]
        if rollout_ids is None:
            return await self._list_page(states, None, limit)
        ids = list(rollout_ids)
        found: list[Rollout] = []
        # Chunks keep the query string of a large window well under URL limits.
        for start in range(0, len(ids), 150):
            found += await self._list_page(states, ids[start : start + 150], limit)
        return found

    async def _list_page(self, states: list[str], ids: list[str] | None, limit: int | None) -> list[Rollout]:
        params: list[tuple[str, str | int]] = [("state_in", s) for s in states]
        params += [("rollout_id", i) for i in ids or ()]
        if limit is not None:
            params.append(("limit", limit))
        return [Rollout.model_validate(r) for r in await self._request("GET", "/api/rollouts", params=params)]

    async def update_status(self, rollout_id: str, **fields: Any) -> Rollout:
        if isinstance(fields.get("state"), RolloutState):
            fields["state"] = fields["state"].value
        body = {"status": fields}
        state = RolloutState(fields["state"]) if fields.get("state") is not None else None
        # Sent twice, a claim of a named attempt or a move to a final state changes nothing the
        # second time (the store answers a repeat as a no-op); a re-queue could undo someone
        # else's claim made in between, so it is not repeated after an ambiguous failure.
        idempotent = state is not None and (
            state.terminal or (state == RolloutState.RUNNING and bool(fields.get("last_attempt_id")))
        )
        return Rollout.model_validate(
            await self._request("PATCH", f"/api/rollouts/{rollout_id}", json=body, idempotent=idempotent)
        )

    async def delete_rollout(self, rollout_id: str) -> None:
        await self._request("DELETE", f"/api/rollouts/{rollout_id}")

    async def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: Any) -> Event:
        body = {"event_type": event_type, "data": data}
        return Event.model_validate(
            await self._request("POST", f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", json=body)
        )

    async def events(
        self, rollout_id: str, event_type: str | None = None, attempt_id: str | None = None
    ) -> list[Event]:
        params = {k: v for k, v in {"event_type": event_type, "attempt_id": attempt_id}.items() if v}
        return [
            Event.model_validate(e)
            for e in await self._request("GET", f"/api/rollouts/{rollout_id}/events", params=params)
        ]

    async def triplets(self, rollout_id: str, attempt_id: str | None = None) -> TripletBundle:
        params = {"format": "samples", **({"attempt_id": attempt_id} if attempt_id else {})}
        return TripletBundle.model_validate(
            await self._request("GET", f"/api/rollouts/{rollout_id}/events", params=params)
        )

    # -- models and pause -----------------------------------------------------------------

    async def register_models(self, endpoints: Iterable[ModelEndpoint | dict[str, Any]]) -> list[ModelEndpoint]:
        body = [e.model_dump() if isinstance(e, ModelEndpoint) else e for e in endpoints]
        return [
            ModelEndpoint.model_validate(e)
            for e in await self._request("POST", "/api/models", json=body, idempotent=True)
        ]

    async def list_models(self) -> list[ModelEndpoint]:
        return [ModelEndpoint.model_validate(e) for e in await self._request("GET", "/api/models")]

    async def set_model_live(self, endpoint: str, live: bool) -> ModelEndpoint:
        """Take a registered endpoint out of rotation (`live=False`: the proxy sends it no
        calls; its rollouts move to the live ones) or put it back. `NotFoundError` if it is
        not registered."""
        return ModelEndpoint.model_validate(
            await self._request(
                "PATCH", "/api/models", params={"endpoint": endpoint}, json={"live": live}, idempotent=True
            )
        )

    async def remove_model(self, endpoint: str) -> list[ModelEndpoint]:
        """Unregister one endpoint (nothing to do if it is not registered); the ones left."""
        return [
            ModelEndpoint.model_validate(e)
            for e in await self._request("DELETE", "/api/models", params={"endpoint": endpoint})
        ]

    async def clear_models(self) -> None:
        await self._request("DELETE", "/api/models")

    async def pause(
        self, reason: str | None = None, retry_after_seconds: float | None = None, expected_seconds: float | None = None
    ) -> ProxyState:
        """`retry_after_seconds`: None = the gateway's `gateway.retry_after_seconds`."""
        body = {"reason": reason, "retry_after_seconds": retry_after_seconds, "expected_seconds": expected_seconds}
        return ProxyState.model_validate(
            await self._request("POST", "/proxy/pause", json=body, timeout=300, idempotent=True)
        )

    async def resume(self) -> ProxyState:
        return ProxyState.model_validate(await self._request("POST", "/proxy/resume", idempotent=True))

    async def proxy_state(self, wait_drained: float | None = None) -> ProxyState:
        params = {"wait_drained": wait_drained} if wait_drained else {}
        timeout = (wait_drained or 0) + 30
        return ProxyState.model_validate(await self._request("GET", "/proxy/state", params=params, timeout=timeout))
