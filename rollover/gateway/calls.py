"""What a proxied call is, from the agent's request to its record: the call as the proxy got it,
the engine's response and where it came from, and the errors the agent is answered with. Shared
by the forwarder (`proxy`) and the streamed answer (`streamed`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from rollover import codec
from rollover.gateway.images import CallImages
from rollover.gateway.upstream import UpstreamIOError, UpstreamResponse, UpstreamTimeout
from rollover.store.models import ModelEndpoint

Mode = Literal["train", "val"]
CALL_ID_HEADER = "X-Agl-Call-Id"


def new_call_id() -> str:
    return "call-" + os.urandom(12).hex()


@dataclass(frozen=True)
class ProxyCall:
    """One agent call as the proxy got it: whose it is, the mode, the OpenAI endpoint and body."""

    rollout_id: str
    attempt_id: str
    mode: Mode
    endpoint: str
    body: dict[str, Any]
    # A call made through another API (`gateway.apis`): its record's `api`, the API's name and
    # the id the agent was given. None: the chat or completions route.
    api: dict[str, Any] | None = None
    # What names the call to the agent (a reward may name it): sent to the engine as the request
    # id (so a chat answer's `id` is `chatcmpl-<call_id>`), returned in the `X-Agl-Call-Id`
    # header and recorded as the call's `call_id`. A translated call's is the id its API gives.
    call_id: str = field(default_factory=new_call_id)
    # Its images (`gateway.images`), recorded by reference and stored once by content; None: none.
    images: CallImages | None = None


class UpstreamError(Exception):
    """A call that ends in an HTTP error for the agent: `{"error": error, "reason": reason}`."""

    def __init__(self, status_code: int, reason: str, error: str = "upstream error") -> None:
        super().__init__(reason)
        self.status_code = status_code
        self.reason = reason
        self.error = error


@dataclass
class Sent:
    """An engine's response, body unread, the endpoint that sent it, the model name it was
    asked for and the policy that name serves (None: the endpoint has one)."""

    target: ModelEndpoint
    response: UpstreamResponse
    model: str
    policy: str | None


@dataclass
class Call:
    """What the record of one proxied call needs besides the answer."""

    proxied: ProxyCall
    sent: Sent
    started: float


def sse_error(message: str) -> bytes:
    return b"data: " + codec.dumps({"error": {"message": message, "type": "upstream_error"}}) + b"\n\n"


async def read_whole(response: UpstreamResponse) -> bytes:
    try:
        return await response.read()
    except UpstreamTimeout as exc:
        raise UpstreamError(504, f"upstream timed out: {exc}") from None
    except UpstreamIOError as exc:
        raise UpstreamError(502, f"upstream failed mid-answer: {exc}") from None


def parsed(raw: bytes) -> tuple[bytes, dict[str, Any]]:
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
