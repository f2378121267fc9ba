"""A streamed engine answer, put back together: the proxy relays the chunks to the agent as
they arrive and records the completion they add up to, shaped as the engine answers without
`stream` (token ids, logprobs and all), so a streamed call is recorded like any other.

With partial rollout it also knows which policy version sampled each token: told the version
at the start and at every weight load (`mark`), it keeps per choice the spans of tokens each
version sampled (`spans`). The engine generates nothing between its freeze and its resume,
and a weight load is marked in between, so every token that arrived before the mark was
sampled with the old weights and every one after it with the new: a line of the stream that
had begun to arrive at the mark was written before the freeze."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rollover import codec


class StreamTranslator(Protocol):
    """Turns the engine's chat stream into another API's events (`gateway.apis`): it sees each
    chunk as the assembler parses it (parsed once, for both), and is asked for what it has to
    send after every piece of the stream."""

    def chunk(self, chunk: dict[str, Any]) -> None:
        """One parsed chunk of the engine's stream."""
        ...

    def take(self) -> bytes:
        """The events made since the last call, for the agent."""
        ...

    def end(self, answer: dict[str, Any]) -> bytes:
        """The closing events, given the whole answer the chunks added up to."""
        ...

    def failed(self, message: str) -> bytes:
        """What is left to send, then the API's in-band error event."""
        ...


class StreamAssembler:
    """Fed the raw bytes of an OpenAI-style server-sent event stream (vLLM's: every chunk one
    `data:` line, `token_ids` per choice, `prompt_token_ids` on the first chunks); `listener`
    gets every chunk parsed."""

    def __init__(
        self, endpoint: str, version: int | None = None, listener: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self._listener = listener
        self.chat = endpoint == "chat/completions"
        self.error: Any = None
        self.done = False  # [DONE] seen
        self.version = version  # None: versions are not followed
        self.spans: dict[int, list[list[int]]] = {}  # per choice: [first token index, version], ...
        self._next_version: int | None = None  # the version once the line under way has ended
        self._partial = b""
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line.rstrip(b"\r"))
            if self._next_version is not None:
                self.version, self._next_version = self._next_version, None

    def mark(self, version: int) -> None:
        """The weights changed to `version`: the tokens of lines that begin from now on are its."""
        if self._partial:
            self._next_version = version
        else:
            self.version = version

    def tokens_under_way(self) -> int:
        """Tokens so far of the choices not yet finished (0: nothing of it is under way)."""
        return sum(len(acc["token_ids"] or []) for acc in self._choices.values() if acc.get("finish_reason") is None)

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # comments, event names, the blank line between events
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            chunk = codec.loads_lenient(payload)
        except codec.JSONCodecError:
            self.error = f"unreadable chunk: {payload[:200].decode(errors='replace')}"
            return
        if not isinstance(chunk, dict):
            return
        if self._listener is not None:
            self._listener(chunk)
        if chunk.get("error") is not None:
            self.error = chunk["error"]
        for key in ("id", "created", "model", "system_fingerprint", "prompt_token_ids"):
            if chunk.get(key) is not None:
                self._top.setdefault(key, chunk[key])
        if chunk.get("usage") is not None:
            self._top["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict):
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        acc = self._choices.setdefault(
            index, {"text": [], "reasoning": [], "tool_calls": {}, "token_ids": None, "logprobs": None, "tokens": []}
        )
        for key in ("finish_reason", "stop_reason", "prompt_token_ids"):
            if choice.get(key) is not None:
                acc[key] = choice[key]
        if isinstance(choice.get("token_ids"), list):
            received = acc["token_ids"] or []
            if self.version is not None and choice["token_ids"]:
                spans = self.spans.setdefault(index, [])
                if not spans or spans[-1][1] != self.version:
                    spans.append([len(received), self.version])
            acc["token_ids"] = received + choice["token_ids"]
        logprobs = choice.get("logprobs") or {}
        if self.chat:
            delta = choice.get("delta") or {}
            if delta.get("role"):
                acc["role"] = delta["role"]
            if delta.get("content"):
                acc["text"].append(delta["content"])
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                acc["reasoning"].append(reasoning)
            for call in delta.get("tool_calls") or []:
                self._tool_call(acc["tool_calls"], call)
            if isinstance(logprobs.get("content"), list):
                acc["logprobs"] = (acc["logprobs"] or []) + logprobs["content"]
        else:
            if choice.get("text"):
                acc["text"].append(choice["text"])
            if isinstance(logprobs.get("token_logprobs"), list):
                acc["logprobs"] = (acc["logprobs"] or []) + logprobs["token_logprobs"]
                acc["tokens"].extend(logprobs.get("tokens") or [])

    @staticmethod
    def _tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
        call = calls.setdefault(delta.get("index", len(calls)), {"function": {"name": "", "arguments": ""}})
        for key in ("id", "type"):
            if delta.get(key):
                call[key] = delta[key]
        function = delta.get("function") or {}
        for key in ("name", "arguments"):
            if function.get(key):
                call["function"][key] += function[key]

    def response(self) -> dict[str, Any]:
        """The completion the chunks add up to, in the engine's non-streamed shape."""
        top = {key: self._top.get(key) for key in ("id", "created", "model")}
        choices = []
        for index in sorted(self._choices):
            acc = self._choices[index]
            text = "".join(acc["text"])
            common = {
                "index": index,
                "finish_reason": acc.get("finish_reason"),
                "stop_reason": acc.get("stop_reason"),
                "token_ids": acc["token_ids"],
            }
            if self.chat:
                message: dict[str, Any] = {"role": acc.get("role", "assistant"), "content": text or None}
                if acc["reasoning"]:
                    message["reasoning_content"] = "".join(acc["reasoning"])
                if acc["tool_calls"]:
                    message["tool_calls"] = [acc["tool_calls"][i] for i in sorted(acc["tool_calls"])]
                elif message["content"] is None:
                    message["content"] = ""
                logprobs = None if acc["logprobs"] is None else {"content": acc["logprobs"]}
                choices.append(common | {"message": message, "logprobs": logprobs})
            else:
                logprobs = (
                    None if acc["logprobs"] is None else {"token_logprobs": acc["logprobs"], "tokens": acc["tokens"]}
                )
                choices.append(
                    common | {"text": text, "logprobs": logprobs, "prompt_token_ids": acc.get("prompt_token_ids")}
                )
        shaped = top | {"object": "chat.completion" if self.chat else "text_completion", "choices": choices}
        if self.chat:
            shaped["prompt_token_ids"] = self._top.get("prompt_token_ids")
        shaped["usage"] = self._top.get("usage")
        if self.error is not None:
            shaped["error"] = self.error
        return shaped
