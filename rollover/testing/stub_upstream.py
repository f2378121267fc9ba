"""A small stand-in for vLLM's OpenAI server, for fast proxy tests and the overhead benchmark.

It answers `chat/completions` and `completions` with vLLM's extra fields (`prompt_token_ids`,
`token_ids`, sampled-token logprobs), deterministically from the request, and can be told to
be slow or to fail so the proxy's retry and cancel paths can be exercised.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollover.gateway.server import free_port, wait_healthy


@dataclass
class StubBehaviour:
    delay_seconds: float = 0.0
    fail_next: int = 0  # answer this many calls with HTTP 500 first
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0


def _fake_ids(text: str, count: int) -> list[int]:
    digest = hashlib.sha256(text.encode()).digest()
    return [digest[i % len(digest)] + i for i in range(count)]


def create_stub_app(behaviour: StubBehaviour) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def answer(kind: str, request: Request) -> JSONResponse:
        body = await request.json()
        behaviour.requests.append(body)
        if behaviour.fail_next > 0:
            behaviour.fail_next -= 1
            return JSONResponse({"error": "injected failure"}, status_code=500)
        delay = (
            float(body.get("metadata", {}).get("stub_delay", behaviour.delay_seconds))
            if isinstance(body.get("metadata"), dict)
            else behaviour.delay_seconds
        )
        # Like vLLM, abandon the generation when the caller hangs up.
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            if await request.is_disconnected():
                behaviour.cancelled += 1
                return JSONResponse({"error": "client went away"}, status_code=499)
        prompt = str(body.get("messages") or body.get("prompt"))
        prompt_ids = _fake_ids(prompt, 8)
        response_ids = _fake_ids(prompt + "reply", 4)
        logprobs = [-0.1 * (i + 1) for i in range(len(response_ids))]
        text = f"echo {len(prompt)}"
        behaviour.completed += 1
        base = {"id": f"cmpl-{behaviour.completed}", "created": int(time.time()), "model": body.get("model")}
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(response_ids), "total_tokens": 12}
        if kind == "chat":
            content = (
                [{"token": f"t{t}", "logprob": lp} for t, lp in zip(response_ids, logprobs)]
                if body.get("logprobs")
                else None
            )
            return JSONResponse(
                base
                | {
                    "object": "chat.completion",
                    "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                            "logprobs": {"content": content} if content else None,
                            "token_ids": response_ids if body.get("return_token_ids") else None,
                        }
                    ],
                    "usage": usage,
                }
            )
        has_logprobs = body.get("logprobs") is not None
        return JSONResponse(
            base
            | {
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "finish_reason": "stop",
                        "logprobs": {"token_logprobs": logprobs, "tokens": [f"t{t}" for t in response_ids]}
                        if has_logprobs
                        else None,
                        "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
                        "token_ids": response_ids if body.get("return_token_ids") else None,
                    }
                ],
                "usage": usage,
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await answer("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await answer("completions", request)

    return app


class StubUpstream:
    """The stub served by uvicorn on a background thread."""

    def __init__(self, behaviour: StubBehaviour | None = None, host: str = "127.0.0.1") -> None:
        self.behaviour = behaviour or StubBehaviour()
        self.host = host
        self.port = free_port(host)
        config = uvicorn.Config(
            create_stub_app(self.behaviour),
            host=host,
            port=self.port,
            log_level="warning",
            access_log=False,
            backlog=4096,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="stub-upstream", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> StubUpstream:
        self._thread.start()
        wait_healthy(f"http://{self.host}:{self.port}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> StubUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """`python -m rollover.testing.stub_upstream --port P [--delay S]`: the stub as its own process."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    app = create_stub_app(StubBehaviour(delay_seconds=args.delay))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, backlog=4096)


if __name__ == "__main__":
    main()
