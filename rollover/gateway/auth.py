"""The gateway's key checks on a request: the admin key, a rollout's readers, an attempt's writer.

Keys are checked first, before the body or the query is looked at: FastAPI routes take the
checks as dependencies, which it runs before it validates their parameters. The keys
themselves (what a scoped key is) are in `keys`.

A scoped key writes (events, proxy calls) only while its attempt is the rollout's running
one, so an agent whose attempt ended cannot write into the next attempt, nor keep writing
into its own.
"""

from __future__ import annotations

from fastapi import HTTPException, Request

from rollover.gateway import keys
from rollover.gateway.state import GatewayState
from rollover.store.models import RolloutState
from rollover.store.sqlite import RolloutNotFound


def presented_key(request: Request) -> str | None:
    """The key from `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    authorization = request.headers.get("authorization", "")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def is_admin(request: Request) -> bool:
    """Whether the request carries the admin key (not an agent's)."""
    return keys.is_admin(_state(request).admin_key, presented_key(request))


def require_admin(request: Request) -> None:
    key = presented_key(request)
    if not keys.is_admin(_state(request).admin_key, key):
        _refuse(key, "this endpoint needs the admin key")


def require_rollout_access(request: Request) -> None:
    """Reading a rollout: the admin key, or the scoped key of any of its attempts."""
    state = _state(request)
    rollout_id = request.path_params["rollout_id"]
    key = presented_key(request)
    if keys.is_admin(state.admin_key, key):
        return
    try:
        attempts = state.store.snapshot(rollout_id).attempts
    except RolloutNotFound:
        attempts = ()
    if keys.scoped_attempt(state.admin_key, key, rollout_id, attempts) is None:
        _refuse(key, f"the key is not valid for rollout {rollout_id}")


def require_attempt_writer(request: Request, rollout_id: str, attempt_id: str) -> None:
    """Writing into an attempt (events, proxy calls): the admin key, or the attempt's own
    scoped key while that attempt is the rollout's running one."""
    state = _state(request)
    key = presented_key(request)
    if keys.is_admin(state.admin_key, key):
        return
    if not keys.is_attempt_key(state.admin_key, key, rollout_id, attempt_id):
        _refuse(key, f"the key is not valid for attempt {attempt_id} of rollout {rollout_id}")
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


def _refuse(key: str | None, reason: str) -> None:
    if key is None:
        raise HTTPException(401, "missing key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    if key.startswith(keys.SCOPED_PREFIX):
        raise HTTPException(403, reason)
    raise HTTPException(401, "invalid key")
