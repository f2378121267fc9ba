"""The proxy's routes for the APIs it translates (`gateway.apis`): Anthropic's Messages (and its
`count_tokens`) and OpenAI's Responses, under each attempt's proxy path.

A call passes the chat route's admission (key, mode, attempt, pause gate), is translated, goes to
the engine's chat/completions through the same `Forwarder` (retries, routing, policies, partial
rollout's versions) and is recorded as a chat call with its API named (`record["api"]`), so
training reads it as any other. Its answer goes back in the API's shape, whole or as the API's
events; every refusal is in the API's error shape."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from rollover import codec
from rollover.gateway.admission import check_attempt, check_images, check_writer, enter, json_object
from rollover.gateway.apis import anthropic, responses
from rollover.gateway.apis.common import ApiError, Translation
from rollover.gateway.calls import CALL_ID_HEADER, ProxyCall, UpstreamError
from rollover.gateway.images import ImageRefused, references, restore_images
from rollover.gateway.relay import RelayedStream, forward_unless_disconnected
from rollover.gateway.sampling import ForbiddenField, check_request
from rollover.gateway.state import GatewayState
from rollover.store.errors import StoreError
from rollover.store.sqlite import RolloutStore

log = logging.getLogger("rollover.gateway.translated")

ATTEMPT_PATH = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}"
ANTHROPIC_MESSAGES_PATH = ATTEMPT_PATH + "/anthropic/v1/messages"
ANTHROPIC_COUNT_TOKENS_PATH = ATTEMPT_PATH + "/anthropic/v1/messages/count_tokens"
RESPONSES_PATH = ATTEMPT_PATH + "/openai/v1/responses"

ErrorBody = Callable[[int, str], dict[str, Any]]
Translate = Callable[[dict[str, Any], Request], Awaitable[Translation]]


def api_error(shape: ErrorBody, status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(shape(status, message), status_code=status, headers=headers)


def refused(exc: Exception, shape: ErrorBody) -> JSONResponse:
    """A request refused before it reached an engine, in the API's error shape."""
    if isinstance(exc, ApiError):
        return api_error(shape, exc.status, exc.message)
    if isinstance(exc, HTTPException):
        return api_error(shape, exc.status_code, str(exc.detail), exc.headers)
    if isinstance(exc, RequestValidationError):
        message = "; ".join(".".join(str(p) for p in e["loc"]) + ": " + str(e["msg"]) for e in exc.errors())
        return api_error(shape, 400, message)
    if isinstance(exc, UpstreamError):
        return api_error(shape, exc.status_code, exc.reason)
    if isinstance(exc, StoreError):
        return api_error(shape, exc.status_code, str(exc))
    raise exc


def engine_message(data: dict[str, Any]) -> str:
    """What an engine's error body says (vLLM's `{"error": {"message"}}`, or `{"message"}`)."""
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if data.get("message"):
        return str(data["message"])
    return str(error or data)[:500]


@dataclass(frozen=True)
class _Context:
    rollout_id: str
    attempt_id: str
    stored: bool  # created with `store: true`: a later call may name it
    messages: list[dict[str, Any]]  # its chat messages (without its instructions) and its answer


class ResponseContexts:
    """What `previous_response_id` continues: each Responses call's chat messages and answer,
    kept for the latest calls and otherwise read back from the store, where every call is
    recorded before its agent has the answer (so a restarted gateway finds them too)."""

    def __init__(self, store: RolloutStore, size: int = 1024) -> None:
        self._store = store
        self._size = size
        self._kept: OrderedDict[str, _Context] = OrderedDict()

    def remember(self, call: ProxyCall, answer: dict[str, Any]) -> None:
        if call.api is not None:
            self._keep(call.api, call.rollout_id, call.attempt_id, call.body, answer)

    def _keep(self, tag: dict[str, Any], rollout_id: str, attempt_id: str, chat: dict[str, Any], answer: Any) -> None:
        messages = list(chat.get("messages") or [])
        if tag.get("instructions"):
            messages = messages[1:]  # a later call does not inherit them (as in OpenAI's API)
        messages.append(responses.assistant_message(answer))
        self._kept[str(tag["id"])] = _Context(rollout_id, attempt_id, bool(tag.get("store", True)), messages)
        self._kept.move_to_end(str(tag["id"]))
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)

    async def prior(self, rollout_id: str, attempt_id: str, response_id: str) -> list[dict[str, Any]]:
        """The chat messages a call continuing `response_id` starts with."""
        context = self._kept.get(response_id)
        if context is None or context.rollout_id != rollout_id:
            context = await self._load(rollout_id, response_id)
        if context is None:
            raise ApiError(404, f"previous_response_id: no response {response_id!r:.100} in this rollout")
        if context.attempt_id != attempt_id:
            raise ApiError(
                403, f"previous_response_id: {response_id!r} belongs to attempt {context.attempt_id}, not this attempt"
            )
        if not context.stored:
            raise ApiError(
                404, f"previous_response_id: {response_id!r} was created with store: false; send the whole context"
            )
        return list(context.messages)

    async def _load(self, rollout_id: str, response_id: str) -> _Context | None:
        for event in await self._store.list_events(rollout_id, event_type="model_request"):
            data = event.data if isinstance(event.data, dict) else {}
            tag, request, answer = data.get("api"), data.get("request"), data.get("response")
            if (
                isinstance(tag, dict)
                and tag.get("name") == "responses"
                and tag.get("id") == response_id
                and data.get("status_code") == 200
                and isinstance(request, dict)
                and isinstance(answer, dict)
            ):
                hashes = references(request)
                if hashes:  # recorded by reference: the engine needs them inline again
                    request = restore_images(request, await self._store.images(hashes))
                self._keep(tag, rollout_id, event.attempt_id, request, answer)
                return self._kept[response_id]
        return None


class TranslatedRoutes:
    """The endpoints; `app` serves them before its router, like the chat route."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.contexts = ResponseContexts(state.store)

    async def anthropic_messages(self, request: Request) -> Response:
        async def translate(body: dict[str, Any], request: Request) -> Translation:
            return anthropic.AnthropicTranslation(body, request.headers.get("anthropic-beta"))

        return await self._serve(request, anthropic.error_body, translate)

    async def responses(self, request: Request) -> Response:
        async def translate(body: dict[str, Any], request: Request) -> Translation:
            parsed = responses.parse_request(body)
            prior: list[dict[str, Any]] = []
            if parsed.previous_response_id is not None:
                params = request.path_params
                prior = await self.contexts.prior(
                    params["rollout_id"], params["attempt_id"], parsed.previous_response_id
                )
            return responses.ResponsesTranslation(parsed, body, prior)

        return await self._serve(request, responses.error_body, translate)

    async def anthropic_count_tokens(self, request: Request) -> Response:
        rollout_id, attempt_id, mode = _ids(request)
        try:
            check_writer(request, rollout_id, attempt_id, mode)
            body = await json_object(request, self.state.settings.gateway.max_json_depth)
            tokenize = anthropic.count_tokens_request(body)
            check_attempt(self.state, rollout_id, attempt_id)
            count = await self.state.forwarder.tokenize(rollout_id, tokenize)
        except (ApiError, HTTPException, RequestValidationError, UpstreamError, StoreError) as exc:
            return refused(exc, anthropic.error_body)
        return JSONResponse({"input_tokens": count})

    async def _serve(self, request: Request, shape: ErrorBody, translate: Translate) -> Response:
        state = self.state
        rollout_id, attempt_id, path_mode = _ids(request)
        try:
            mode = check_writer(request, rollout_id, attempt_id, path_mode)
            body = await json_object(request, state.settings.gateway.max_json_depth)
            translation = await translate(body, request)
            # What the translation asks of the engine passes the chat route's check: in train
            # mode nothing that makes the recorded logprobs other than the policy's (a forced
            # tool choice is guided decoding).
            check_request(translation.chat_body, "chat/completions", mode, state.settings.max_n)
            check_attempt(state, rollout_id, attempt_id)
            images = await check_images(state, rollout_id, translation.chat_body)
        except ForbiddenField as exc:
            return api_error(shape, 400, f"{exc.field}: {exc.reason}")
        except (ApiError, HTTPException, RequestValidationError, UpstreamError, StoreError) as exc:
            return refused(exc, shape)
        except ImageRefused as exc:
            return api_error(shape, 400, str(exc))
        state.note_unhonoured(translation.api, translation.unhonoured)
        refusal = await enter(state)
        if refusal is not None:
            return api_error(shape, 429, f"gateway paused: {refusal.reason}", refusal.headers)
        tag = translation.tag
        call = ProxyCall(
            rollout_id, attempt_id, mode, "chat/completions", translation.chat_body, tag, tag["id"], images
        )
        remember = (lambda answer: self.contexts.remember(call, answer)) if translation.api == "responses" else None
        if translation.streamed:
            return await self._stream(call, translation, shape, remember)
        try:
            status, _, data = await forward_unless_disconnected(request, state.forwarder, call)
        except UpstreamError as exc:
            return api_error(shape, exc.status_code, exc.reason)
        finally:
            await state.pause.leave()
        if status != 200:
            return api_error(shape, status, engine_message(data))
        if remember is not None:
            remember(data)
        return Response(
            codec.dumps(translation.answer(data)),
            media_type="application/json",
            headers={CALL_ID_HEADER: call.call_id},
        )

    async def _stream(
        self,
        call: ProxyCall,
        translation: Translation,
        shape: ErrorBody,
        remember: Callable[[dict[str, Any]], None] | None,
    ) -> Response:
        leave = self.state.pause.leave
        try:
            streamed = await self.state.forwarder.stream(call, translation.stream())
        except UpstreamError as exc:
            await leave()
            return api_error(shape, exc.status_code, exc.reason)
        except BaseException:
            await leave()
            raise
        if streamed.status == 200:
            return RelayedStream(streamed, leave, streamed.events(remember), call.call_id)
        try:
            _, data = await streamed.read()
        except UpstreamError as exc:
            return api_error(shape, exc.status_code, exc.reason)
        finally:
            try:
                await streamed.close()
            finally:
                await leave()
        return api_error(shape, streamed.status, engine_message(data))


def _ids(request: Request) -> tuple[str, str, str]:
    params = request.path_params
    return params["rollout_id"], params["attempt_id"], params["mode"]
