"""What every proxied call passes before it reaches an engine, whatever its API: the attempt's
key and mode, its rollout still running that attempt, its body as a JSON object, and the pause
gate that counts it in flight (or refuses it with when to come back)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError

from rollover import codec
from rollover.gateway import auth
from rollover.gateway.calls import Mode
from rollover.gateway.images import CallImages, call_images, check_count, has_images
from rollover.gateway.state import GatewayState


@dataclass(frozen=True)
class Refusal:
    """A call refused while the gateway is paused: why, and the headers that say when to come
    back (`Retry-After`, and `retry-after-ms` when the pause's length was announced)."""

    reason: str | None
    headers: dict[str, str]


def check_writer(request: Request, rollout_id: str, attempt_id: str, mode: str) -> Mode:
    """The attempt's own key (or the admin key), and a mode of `train` or `val`."""
    auth.require_attempt_writer(request, rollout_id, attempt_id)
    if mode in ("train", "val"):
        return cast(Mode, mode)
    raise RequestValidationError([{"loc": ("path", "mode"), "msg": "Input should be 'train' or 'val'"}])


def check_attempt(state: GatewayState, rollout_id: str, attempt_id: str) -> None:
    """The rollout still runs and has the attempt (in memory: no round trip to the store)."""
    rollout = state.store.snapshot(rollout_id)
    if rollout.state.terminal:
        raise HTTPException(409, f"rollout {rollout_id} is already {rollout.state.value}")
    if attempt_id not in rollout.attempts:
        raise HTTPException(404, f"rollout {rollout_id} has no attempt {attempt_id}")


async def json_body(request: Request, max_depth: int) -> Any:
    """The body as JSON whatever its Content-Type says (agents and curl are not always careful)."""
    raw = await request.body()
    try:
        return codec.loads(raw, max_depth=max_depth)
    except codec.JSONCodecError as exc:
        raise HTTPException(
            400,
            f"body refused: {exc}. Send standard JSON: no NaN or Infinity, no lone surrogates,"
            f" at most {max_depth} levels deep (gateway.max_json_depth)",
        ) from None


async def json_object(request: Request, max_depth: int) -> dict[str, Any]:
    body = await json_body(request, max_depth)
    if not isinstance(body, dict):
        raise HTTPException(400, "body must be a JSON object")
    return body


async def check_images(state: GatewayState, rollout_id: str, body: dict[str, Any]) -> CallImages | None:
    """A chat request's images, decoded and checked (`gateway.images`), against what the engine
    the rollout goes to takes; raises `ImageRefused`. Decoded off the event loop: a large image
    takes milliseconds that other agents' calls should not wait for."""
    if not has_images(body):
        return None
    target = state.registry.pick(rollout_id)
    if target is not None and target.max_images == 0:
        check_count(None, 0)  # a text-only model: refused before anything is decoded
    images = await asyncio.to_thread(call_images, body, state.settings.gateway.max_image_bytes)
    if target is not None:  # none live: the forwarder answers that
        check_count(images, target.max_images)
    return images


async def enter(state: GatewayState) -> Refusal | None:
    """Count the call in flight, or (paused) the refusal; with `gateway.hold_while_paused` a
    call waits up to `gateway.max_hold_seconds` for the resume first."""
    gateway = state.settings.gateway
    refused = await state.pause.try_enter(gateway.max_hold_seconds if gateway.hold_while_paused else 0.0)
    if refused is None:
        return None
    paused, (seconds, retry_after_ms) = refused
    headers = {
        "Retry-After": str(int(seconds)) if float(seconds).is_integer() else str(seconds),
        "X-Agl-Paused": "true",
    }
    if retry_after_ms is not None:
        headers["retry-after-ms"] = str(retry_after_ms)
    return Refusal(paused.reason, headers)
