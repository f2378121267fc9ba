"""OpenAI's Responses API (`POST .../openai/v1/responses`), as the OpenAI Agents SDK and Codex call
it, translated to the engine's chat/completions.

- `input` (a string, or items: messages, `function_call`, `function_call_output`) becomes chat
  messages after `instructions` (a system message); function `tools` and `tool_choice` are the
  chat request's. `previous_response_id` puts the earlier call's context and answer first (the
  gateway keeps every attempt's calls in the store: `ResponseContexts`); with `store: false` the
  client sends the whole context itself.
- The answer comes back as `message` and `function_call` output items (tool calls parsed by the
  engine's own parser), with `usage`, `status` `completed` or `incomplete`; streamed as the
  API's events (`response.created`, `response.output_item.added`,
  `response.output_text.delta`, `response.function_call_arguments.delta`, ...,
  `response.completed`).
- Fields the engine cannot honour (`reasoning`, `truncation`, a `text` format other than plain
  text, hosted tools, ...) are accepted and reported, never passed on.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from rollover.gateway.apis.common import (
    SLOT,
    ApiError,
    ApiName,
    ChatAnswer,
    EventBuffer,
    EventTemplate,
    function_tool,
    image_part,
    new_id,
    sse,
    validated,
)

ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape, which its SDK turns into the matching exception."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Open):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Open):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class FilePart(_Open):
    type: Literal["input_file"]


Part = Annotated[TextPart | RefusalPart | ImagePart | FilePart, Field(discriminator="type")]


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Open):
    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")  # an "easy" message has no type
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class ResponsesRequest(_Open):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    include: list[str] | None = None  # no includable output exists here: an empty list is the SDKs' default
    # Sampling is the gateway's to set, as on the chat route: accepted, not reported.
    temperature: float | None = None
    top_p: float | None = None


_READ = frozenset(ResponsesRequest.model_fields) - {"include"}


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    request = validated(ResponsesRequest, body)
    if body.get("conversation") is not None:
        raise ApiError(
            400, "conversation: conversations are not served here; use previous_response_id or send the context"
        )
    if body.get("background"):
        raise ApiError(400, "background: background responses are not served here; call without it")
    return request


class ResponsesTranslation:
    """One Responses call: the chat request it becomes (after `prior`, the chat messages of the
    call named by `previous_response_id`) and its answer's way back."""

    api: ApiName = "responses"

    def __init__(self, request: ResponsesRequest, body: dict[str, Any], prior: list[dict[str, Any]]) -> None:
        self.request = request
        self.streamed = request.stream
        self.response_id = new_id("resp_")
        self.created_at = int(time.time())
        unhonoured = [key for key in body if key not in _READ and not (key == "include" and not body[key])]
        text = body.get("text")
        if isinstance(text, dict) and (text.get("format") or {}).get("type", "text") == "text":
            unhonoured.remove("text")  # plain text is what the engine answers anyway
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        messages.extend(prior)
        items = [MessageItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
        messages.extend(chat_messages(items, unhonoured))
        chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
        if request.max_output_tokens is not None:
            chat["max_tokens"] = request.max_output_tokens
        tools = _tools(request.tools or [], unhonoured)
        if tools:
            chat["tools"] = tools
            if request.tool_choice is not None:
                chat["tool_choice"] = _tool_choice(request.tool_choice, unhonoured)
            if request.parallel_tool_calls is not None:
                chat["parallel_tool_calls"] = request.parallel_tool_calls
        self.chat_body = chat
        self.unhonoured = tuple(sorted(set(unhonoured)))

    @property
    def tag(self) -> dict[str, Any]:
        """The record's `api`: the response id, whether `previous_response_id` may name it
        (`store`), and whether its first chat message is its `instructions` (which a later
        call does not inherit, as in OpenAI's API)."""
        return {
            "name": self.api,
            "id": self.response_id,
            "store": self.request.store,
            "instructions": bool(self.request.instructions),
        }

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return self._response(ChatAnswer.of(chat), "completed")

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)

    def _response(self, found: ChatAnswer | None, status: str) -> dict[str, Any]:
        request = self.request
        output: list[dict[str, Any]] = []
        incomplete = None
        if found is not None:
            output = output_items(self.response_id, found)
            if found.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        usage = None
        if found is not None:
            usage = {
                "input_tokens": found.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": found.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": found.prompt_tokens + found.completion_tokens,
            }
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": request.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "temperature": request.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": request.metadata or {},
        }


def chat_messages(items: list[Any], unhonoured: list[str]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant message before it (as
    the engine answered it: text, then its calls), a call's output is a `tool` message."""
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(items):
        where = f"input.{position}"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item.content, where)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # The calls of one answer follow its text (the engine answers both in one turn).
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output, where)})
        else:  # reasoning: the served models' templates render no earlier reasoning
            unhonoured.append("reasoning items")
    return messages


def _content(content: str | list[Any], where: str) -> Any:
    """A message's content: its text, or (with images) its text and images as chat parts."""
    if isinstance(content, str):
        return content
    if not any(isinstance(part, ImagePart) for part in content):
        return "".join(_part(part, f"{where}.content.{index}")["text"] for index, part in enumerate(content))
    return [_part(part, f"{where}.content.{index}") for index, part in enumerate(content)]


def _part(part: Any, where: str) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, RefusalPart):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, ImagePart):
        if part.image_url is None:
            raise ApiError(400, f"{where}: images are taken as image_url (a data: URL), not by file_id")
        return image_part(part.image_url, f"{where}.image_url")
    raise ApiError(400, f"{where}: files are not served here; send their text")


def _tools(tools: list[dict[str, Any]], unhonoured: list[str]) -> list[dict[str, Any]]:
    out = []
    for position, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"tools.{position}: a tool is an object")
        if tool.get("type") != "function":
            unhonoured.append(f"tools[type={tool.get('type')}]")  # hosted tools: the engine runs none
            continue
        name, description, parameters = tool.get("name"), tool.get("description"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tools.{position}.name: a function tool has a name")
        if not (description is None or isinstance(description, str)):
            raise ApiError(400, f"tools.{position}.description: a string")
        if not (parameters is None or isinstance(parameters, dict)):
            raise ApiError(400, f"tools.{position}.parameters: a JSON schema object")
        if tool.get("strict"):
            unhonoured.append("tools.strict")  # strict schemas mean guided decoding
        out.append(function_tool(name, description, parameters))
    return out


def _tool_choice(choice: str | dict[str, Any], unhonoured: list[str]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        unhonoured.append(f"tool_choice[type={choice.get('type')}]")
        return "auto"
    raise ApiError(400, f"tool_choice: 'auto', 'none', 'required' or a function, not {choice!r:.100}")


def item_id(response_id: str, kind: str, index: int) -> str:
    """An output item's id, the same in the streamed events and the final response."""
    return f"{kind}_{response_id.removeprefix('resp_')}_{index}"


def output_items(response_id: str, found: ChatAnswer) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if found.text:
        items.append(_message_item(response_id, len(items), found.text, "completed"))
    for call in found.tool_calls:
        items.append(_call_item(response_id, len(items), call.id, call.name, call.arguments, "completed"))
    return items


def _message_item(response_id: str, index: int, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {
        "id": item_id(response_id, "msg", index),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _call_item(response_id: str, index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id(response_id, "fc", index),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def assistant_message(chat: dict[str, Any]) -> dict[str, Any]:
    """The engine's answer as the assistant chat message a later call's context holds (what
    the client would send back as output items)."""
    found = ChatAnswer.of(chat)
    message: dict[str, Any] = {"role": "assistant", "content": found.text or None}
    if found.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in found.tool_calls
        ]
    elif message["content"] is None:
        message["content"] = ""
    return message


class ResponsesStream(EventBuffer):
    """The engine's chat chunks as the Responses API's events, each with its
    `sequence_number`: `response.created`, `response.in_progress`, per output item
    `response.output_item.added`, its deltas and `...done` events, then `response.completed`."""

    def __init__(self, call: ResponsesTranslation) -> None:
        super().__init__()
        self._call = call
        self._sequence = 0
        self._started = False
        self._open: tuple[str, int] | None = None  # ("text", 0) or ("call", tool-call index)
        self._items: list[dict[str, Any]] = []  # output items so far, the open one last
        self._text: list[str] = []
        self._delta_event: EventTemplate | None = None  # the open item's deltas

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        self._out.append(sse(kind, {"type": kind, "sequence_number": self._sequence, **data}))
        self._sequence += 1

    @staticmethod
    def _template(kind: str, data: dict[str, Any]) -> EventTemplate:
        """An event `_emit` would write, its sequence number and `SLOT`s in `data` left to fill."""
        return EventTemplate(kind, {"type": kind, "sequence_number": SLOT, **data})

    def _emit_delta(self, value: str) -> None:
        """A delta of the open item (its text, or its call's arguments)."""
        assert self._delta_event is not None, "a delta comes after its item's start"
        self._out.append(self._delta_event.fill(self._sequence, value))
        self._sequence += 1

    def _start(self) -> None:
        self._started = True
        shell = self._call._response(None, "in_progress")
        self._emit("response.created", {"response": shell})
        self._emit("response.in_progress", {"response": shell})

    def chunk(self, chunk: dict[str, Any]) -> None:
        if not self._started:
            self._start()
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._call_delta(call)

    def _text_delta(self, text: str) -> None:
        if self._open != ("text", 0):
            self._close()
            index = len(self._items)
            item = _message_item(self._call.response_id, index, "", "in_progress")
            self._items.append(item)
            self._open = ("text", 0)
            self._text = []
            self._emit("response.output_item.added", {"output_index": index, "item": item})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._emit(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            )
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self._delta_event = self._template("response.output_text.delta", where | {"delta": SLOT, "logprobs": []})
        self._text.append(text)
        self._emit_delta(text)

    def _call_delta(self, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        index = call.get("index", 0)
        if self._open != ("call", index):
            self._close()
            output_index = len(self._items)
            call_id = call.get("id") or f"call_{index}"
            item = _call_item(
                self._call.response_id, output_index, call_id, function.get("name") or "", "", "in_progress"
            )
            self._items.append(item)
            self._open = ("call", index)
            self._emit("response.output_item.added", {"output_index": output_index, "item": item})
            where = {"item_id": item["id"], "output_index": output_index, "delta": SLOT}
            self._delta_event = self._template("response.function_call_arguments.delta", where)
        if function.get("arguments"):
            self._items[-1]["arguments"] += function["arguments"]
            self._emit_delta(function["arguments"])

    def _close(self) -> None:
        if self._open is None:
            return
        output_index = len(self._items) - 1
        item = self._items[-1]
        if self._open[0] == "text":
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            where = {"item_id": item["id"], "output_index": output_index, "content_index": 0}
            self._emit("response.output_text.done", where | {"text": text, "logprobs": []})
            self._emit("response.content_part.done", where | {"part": part})
            item.update(status="completed", content=[part])
        else:
            self._emit(
                "response.function_call_arguments.done",
                {"item_id": item["id"], "output_index": output_index, "arguments": item["arguments"]},
            )
            item["status"] = "completed"
        self._emit("response.output_item.done", {"output_index": output_index, "item": item})
        self._open = None

    def end(self, answer: dict[str, Any]) -> bytes:
        if not self._started:
            self._start()
        self._close()
        final = self._call.answer(answer)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        self._emit(kind, {"response": final})
        return self.take()

    def failed(self, message: str) -> bytes:
        self._emit("error", {"code": "server_error", "message": message, "param": None})
        return self.take()
