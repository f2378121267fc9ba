"""An agent for Agent Lightning's own controller, run by its Python 3.12 venv: Agent
Lightning's env contract, httpx only (what that venv has), no Rollover import."""

from __future__ import annotations

import os

import httpx


class Agent:
    def run(self) -> None:
        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        reply = httpx.post(
            f"{os.environ['AGL_OPENAI_BASE_URL']}/chat/completions",
            json={"model": "any", "messages": [{"role": "user", "content": "2+2?"}]},
            headers=headers,
            timeout=60,
        )
        reply.raise_for_status()
        assert reply.json()["choices"][0]["message"]["content"]
        httpx.post(
            os.environ["AGL_EVENT_URL"],
            json={"event_type": "reward", "data": {"value": 1.0}},
            headers=headers,
            timeout=30,
        ).raise_for_status()
