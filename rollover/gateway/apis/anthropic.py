"""Anthropic's Messages API (`POST .../anthropic/v1/messages`, `.../count_tokens`), as Claude Code,
the Claude Agent SDK and the Anthropic SDK call it, translated to the engine's chat/completions.

- `system` becomes the system message, `tools` (client tools: `input_schema`) the chat tools,
  `tool_use` blocks an assistant's `tool_calls` (their `input` as JSON arguments), `tool_result`
  blocks `tool` messages, `stop_sequences` the engine's `stop`, `tool_choice` its chat
  equivalent. An assistant message last is a prefill: the engine continues it.
- The answer comes back as `text` and `tool_use` blocks (tool calls parsed by the engine's own
  parser), `stop_reason` `end_turn`, `max_tokens`, `tool_use` or `stop_sequence`, and `usage`;
  streamed as Anthropic's event sequence.
- Fields and headers the engine cannot honour (`thinking`, `context_management`,
  `output_config`, `metadata`, `cache_control`, server tools, `anthropic-beta`, ...) are
  accepted and reported (`Translation.unhonoured`), never passed on.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollover.gateway.apis.common import (
    SLOT,
    ApiError,
    ApiName,
    ChatAnswer,
    EventBuffer,
    EventTemplate,
    arguments_object,
    function_tool,
    image_part,
    new_id,
    sse,
    validated,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape, which its SDK turns into the matching exception."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class _Open(BaseModel):
    # Fields a block may carry that change nothing here (`cache_control`, `citations`) are kept
    # (`model_extra`) and reported; a wrong type is refused.
    model_config = ConfigDict(extra="allow", strict=True)


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ImageBlock(_Open):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Open):
    # `system` among the messages: Claude Code sends its environment that way (after the first
    # user turn); it stays a system message at its place.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Open):
    """The body of `count_tokens`; `MessagesRequest` adds what generating needs."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Sampling is the gateway's to set (the mode's temperature; the full distribution in train
    # mode), as on the chat route: accepted, not reported.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


# Top-level fields read above; anything else in a body is reported as not honoured.
_READ = frozenset(MessagesRequest.model_fields)


class AnthropicTranslation:
    """One Messages call: the chat request it becomes and its answer's way back."""

    api: ApiName = "anthropic"

    def __init__(self, body: dict[str, Any], beta_header: str | None = None) -> None:
        request = validated(MessagesRequest, body)
        self.model = request.model
        self.streamed = request.stream
        self.message_id = new_id("msg_")
        self.stop_sequences = tuple(request.stop_sequences or ())
        unhonoured = [key for key in body if key not in _READ]
        if beta_header:
            unhonoured.append("anthropic-beta")
        self.chat_body = chat_request(request, unhonoured)
        self.chat_body["max_tokens"] = request.max_tokens
        self.chat_body["stream"] = request.stream
        if request.stop_sequences:
            self.chat_body["stop"] = list(request.stop_sequences)
        self.unhonoured = tuple(sorted(set(unhonoured)))

    @property
    def tag(self) -> dict[str, Any]:
        return {"name": self.api, "id": self.message_id}

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        found = ChatAnswer.of(chat)
        content: list[dict[str, Any]] = []
        if found.reasoning:
            content.append({"type": "thinking", "thinking": found.reasoning, "signature": ""})
        if found.text:
            content.append({"type": "text", "text": found.text})
        for call in found.tool_calls:
            content.append(
                {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call.arguments)}
            )
        stop_reason, stop_sequence = self._stop(found.finish_reason, found.stop_reason, bool(found.tool_calls))
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(found.prompt_tokens, found.completion_tokens),
        }

    def stream(self) -> AnthropicStream:
        return AnthropicStream(self)

    def _stop(self, finish_reason: str | None, matched: Any, called: bool) -> tuple[str, str | None]:
        if called or finish_reason == "tool_calls":
            return "tool_use", None
        if finish_reason == "length":
            return "max_tokens", None
        if isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None


def count_tokens_request(body: dict[str, Any]) -> dict[str, Any]:
    """The engine's `/tokenize` request for a `count_tokens` body: the messages and tools as a
    generation would render them."""
    request = validated(CountTokensRequest, body)
    chat = chat_request(request, [])
    tokenize = {"model": request.model, "messages": chat["messages"], "add_generation_prompt": True}
    if "tools" in chat:
        tokenize["tools"] = chat["tools"]
    return tokenize


def chat_request(request: CountTokensRequest, unhonoured: list[str]) -> dict[str, Any]:
    """The messages, tools and tool choice of a chat request; what cannot be honoured is
    appended to `unhonoured`."""
    messages: list[dict[str, Any]] = []
    if request.system:
        if isinstance(request.system, str):
            system = request.system
        else:
            system = "\n\n".join(block.text for block in request.system)
            _note_extras(request.system, unhonoured)
        messages.append({"role": "system", "content": system})
    tool_use_ids: set[str] = set()
    for position, message in enumerate(request.messages):
        where = f"messages.{position}"
        blocks: list[Any] = (
            [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        )
        _note_extras(blocks, unhonoured)
        if message.role == "assistant":
            messages.append(_assistant(blocks, where, tool_use_ids, unhonoured))
        elif message.role == "system":
            messages.append({"role": "system", "content": _system_text(blocks, where)})
        else:
            messages.extend(_user(blocks, where, tool_use_ids))
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        # A prefill: the answer continues the assistant's text, as Anthropic's API does.
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    tools = []
    for position, tool in enumerate(request.tools or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ApiError(400, f"tools.{position}: a tool is an object with a string name")
        if tool.get("type") in (None, "custom") and "input_schema" in tool:
            schema = tool["input_schema"]
            description = tool.get("description")
            if not isinstance(schema, dict) or not (description is None or isinstance(description, str)):
                raise ApiError(400, f"tools.{position}: input_schema must be an object, description a string")
            tools.append(function_tool(tool["name"], description, schema))
            if "cache_control" in tool:
                unhonoured.append("cache_control")
        else:  # a server tool (web search, code execution, ...): the engine runs none
            unhonoured.append(f"tools[type={tool.get('type')}]")
    if tools:
        chat["tools"] = tools
    choice = request.tool_choice
    if choice is not None and tools:
        if choice.type == "tool":
            if not choice.name:
                raise ApiError(400, "tool_choice.name: a tool choice of type 'tool' names the tool")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat


def _assistant(blocks: list[Any], where: str, tool_use_ids: set[str], unhonoured: list[str]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            tool_use_ids.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            # The served models' templates render no thinking of earlier turns.
            unhonoured.append(f"{block.type} blocks")
        else:
            raise ApiError(400, f"{where}.content.{index}: a {block.type} block cannot be in an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], where: str, tool_use_ids: set[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        place = f"{where}.content.{index}"
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in tool_use_ids:
                raise ApiError(
                    400,
                    f"{place}: tool_result names tool_use_id {block.tool_use_id!r}, which no earlier tool_use block has",
                )
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block, place)})
        elif isinstance(block, ImageBlock):
            parts.append(_image(block, place))
        else:
            raise ApiError(400, f"{place}: a {block.type} block cannot be in a user message")
    if parts:
        content: Any = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        results.append({"role": "user", "content": content})
    return results


def _system_text(blocks: list[Any], where: str) -> str:
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise ApiError(400, f"{where}.content.{index}: a {block.type} block cannot be in a system message")
        texts.append(block.text)
    return "\n\n".join(texts)


def _result(block: ToolResultBlock, place: str) -> Any:
    """A tool result's content: its text, or its text and images as parts (a screenshot)."""
    if isinstance(block.content, str):
        return block.content
    if not any(isinstance(part, ImageBlock) for part in block.content):
        return "\n".join(part.text for part in block.content if isinstance(part, TextBlock))
    return [
        _image(part, f"{place}.content.{index}")
        if isinstance(part, ImageBlock)
        else {"type": "text", "text": part.text}
        for index, part in enumerate(block.content)
    ]


def _image(block: ImageBlock, place: str) -> dict[str, Any]:
    """An image block's source (`base64` or a data: `url`) as an `image_url` part."""
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise ApiError(400, f"{place}.source: a base64 source has string media_type and data")
        return image_part(f"data:{media_type};base64,{data}", f"{place}.source")
    if kind == "url":
        return image_part(source.get("url"), f"{place}.source.url")
    raise ApiError(400, f"{place}.source: only base64 and url image sources are taken, not {kind!r:.50}")


def _note_extras(blocks: list[Any], unhonoured: list[str]) -> None:
    for block in blocks:
        if block.model_extra:
            unhonoured.extend(block.model_extra)


def _usage(prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


# a block's kind: its deltas' type and the field that holds their text
_DELTAS: dict[str, tuple[str, str]] = {
    "thinking": ("thinking_delta", "thinking"),
    "text": ("text_delta", "text"),
    "tool": ("input_json_delta", "partial_json"),
}


class AnthropicStream(EventBuffer):
    """The engine's chat chunks as Anthropic's events: `message_start`, per content block
    `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
    `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`."""

    def __init__(self, call: AnthropicTranslation) -> None:
        super().__init__()
        self._call = call
        self._started = False
        self._open: tuple[str, int] | None = None  # the open block's kind and tool-call index
        self._index = -1  # the open block's content index
        self._delta_event: EventTemplate | None = None  # the open block's deltas
        self._prompt_tokens = 0
        self._output_tokens = 0
        self._finish_reason: str | None = None
        self._matched: Any = None
        self._called = False

    def chunk(self, chunk: dict[str, Any]) -> None:
        if not self._started:
            prompt_ids = chunk.get("prompt_token_ids")
            self._prompt_tokens = len(prompt_ids) if isinstance(prompt_ids, list) else 0
            self._start()
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self._block("thinking", 0, {"type": "thinking", "thinking": "", "signature": ""})
                self._delta(reasoning)
            if delta.get("content"):
                self._block("text", 0, {"type": "text", "text": ""})
                self._delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._tool_call(call)
            if isinstance(choice.get("token_ids"), list):
                self._output_tokens += len(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
                self._matched = choice.get("stop_reason")

    def _tool_call(self, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        index = call.get("index", 0)
        if self._open != ("tool", index):
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or f"call_{index}",
                "name": function.get("name") or "",
                "input": {},
            }
            self._block("tool", index, block)
            self._called = True
        if function.get("arguments"):
            self._delta(function["arguments"])

    def _start(self) -> None:
        self._started = True
        message: dict[str, Any] = {
            "id": self._call.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self._prompt_tokens, 0),
        }
        self._out.append(sse("message_start", {"type": "message_start", "message": message}))

    def _block(self, kind: str, tool_index: int, block: dict[str, Any]) -> None:
        if self._open == (kind, tool_index):
            return
        self._close()
        self._index += 1
        self._open = (kind, tool_index)
        self._out.append(
            sse("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )
        delta_type, field = _DELTAS[kind]
        data = {"type": "content_block_delta", "index": self._index, "delta": {"type": delta_type, field: SLOT}}
        self._delta_event = EventTemplate("content_block_delta", data)

    def _delta(self, value: str) -> None:
        """A delta of the open block (its text, thinking or tool input's JSON)."""
        assert self._delta_event is not None, "a delta comes after its block's start"
        self._out.append(self._delta_event.fill(value))

    def _close(self) -> None:
        if self._open is not None:
            self._out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None

    def end(self, answer: dict[str, Any]) -> bytes:
        if not self._started:
            self._start()
        self._close()
        usage = answer.get("usage") or {}
        output_tokens = self._output_tokens or int(usage.get("completion_tokens") or 0)
        stop_reason, stop_sequence = self._call._stop(self._finish_reason, self._matched, self._called)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        self._out.append(
            sse("message_delta", {"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}})
        )
        self._out.append(sse("message_stop", {"type": "message_stop"}))
        return self.take()

    def failed(self, message: str) -> bytes:
        return self.take() + sse("error", error_body(502, message))
