"""What the translated APIs share: the error a request is refused with, the per-call
`Translation` the proxy drives, the engine's answer read once (`ChatAnswer`), the tools and
images every API turns into the chat request, and server-sent events."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from rollover import codec
from rollover.gateway.images import NO_NETWORK
from rollover.gateway.streaming import StreamTranslator

ApiName = Literal["anthropic", "responses"]
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A request the gateway refuses, answered in the API's own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def validation_message(exc: ValidationError) -> str:
    """Pydantic's errors as one line naming each field's place in the body."""
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else str(error["msg"]))
    more = len(exc.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def validated(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ApiError(400, validation_message(exc)) from None


class Translation(Protocol):
    """One agent call in another API's shape, translated for the engine's chat/completions."""

    @property
    def api(self) -> ApiName: ...

    @property
    def chat_body(self) -> dict[str, Any]:
        """The engine request, as an agent of the chat route would send it."""
        ...

    @property
    def unhonoured(self) -> tuple[str, ...]:
        """The request's fields and headers the engine cannot honour: accepted, not passed on."""
        ...

    @property
    def tag(self) -> dict[str, Any]:
        """What the call's record keeps of the API (`record["api"]`): its name and the id the
        agent was given."""
        ...

    @property
    def streamed(self) -> bool: ...

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The engine's whole answer (a chat.completion) in the API's shape."""
        ...

    def stream(self) -> StreamTranslator:
        """A translator of the engine's stream into the API's events."""
        ...


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatAnswer:
    """The first choice of the engine's chat answer, read once for any API's shape."""

    text: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    stop_reason: Any  # vLLM's: the stop string matched, a stop token id, or None
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, chat: dict[str, Any]) -> ChatAnswer:
        choices = chat.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        calls = []
        for position, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            calls.append(
                ToolCall(
                    id=str(call.get("id") or f"call_{position}"),
                    name=str(function.get("name") or ""),
                    arguments=str(function.get("arguments") or ""),
                )
            )
        usage = chat.get("usage") or {}
        prompt_ids = chat.get("prompt_token_ids")
        token_ids = choice.get("token_ids")
        return cls(
            text=message.get("content") or "",
            reasoning=message.get("reasoning_content") or message.get("reasoning") or None,
            tool_calls=tuple(calls),
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=len(prompt_ids) if isinstance(prompt_ids, list) else int(usage.get("prompt_tokens") or 0),
            completion_tokens=len(token_ids)
            if isinstance(token_ids, list)
            else int(usage.get("completion_tokens") or 0),
        )


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object the agent gets (Anthropic's `input`); arguments
    that are no JSON object (a model's malformed call) become an empty object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool as the chat route takes it (and the model's chat template renders it)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def image_part(url: Any, where: str) -> dict[str, Any]:
    """An image as the chat route takes it (an `image_url` part). Its data is checked where
    every route's images are (`gateway.images`), as is whether the served model takes images."""
    if not isinstance(url, str):
        raise ApiError(400, f"{where}: an image is given as a data: URL string")
    if url.startswith(("http://", "https://")):
        raise ApiError(400, f"{where}: {NO_NETWORK}")
    return {"type": "image_url", "image_url": {"url": url}}


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


class EventBuffer:
    """The events a stream translator has made and not yet handed to the relay."""

    def __init__(self) -> None:
        self._out: list[bytes] = []

    def take(self) -> bytes:
        out, self._out = b"".join(self._out), []
        return out


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its name, as Anthropic's and OpenAI's streams write them."""
    return b"event: " + event.encode() + b"\ndata: " + codec.dumps(data) + b"\n\n"


# Where an `EventTemplate`'s values go. Only the template's own data is split on it, so the
# values filled in may hold anything; its other values (ids, indices, types) are the gateway's.
SLOT = "\x00slot\x00"
_SLOT_JSON = codec.dumps(SLOT)


class EventTemplate:
    """An event written for every token with only a few values changing (a delta's text, a
    sequence number): encoded once with `SLOT` for each, then filled by concatenation, so a
    token costs the encoding of its own values and not that of the whole event.
    `EventTemplate("e", {"n": SLOT, "text": SLOT}).fill(3, "hi") == sse("e", {"n": 3, "text": "hi"})`."""

    __slots__ = ("_head", "_rest")

    def __init__(self, event: str, data: dict[str, Any]) -> None:
        self._head, *self._rest = sse(event, data).split(_SLOT_JSON)

    def fill(self, *values: str | int) -> bytes:
        """The event with `values` in its slots, in the order the slots are written."""
        if len(values) != len(self._rest):
            raise ValueError(f"the template has {len(self._rest)} slots, given {len(values)} values")
        out = self._head
        for value, piece in zip(values, self._rest):
            out += codec.dumps(value) + piece
        return out
