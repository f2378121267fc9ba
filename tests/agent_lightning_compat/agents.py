"""Agents written for Agent Lightning v1.0: its env contract only, no Rollover import."""

from __future__ import annotations

import os

import httpx
from openai import OpenAI


def _post(event_type: str, data: dict) -> None:
    response = httpx.post(
        os.environ["AGL_EVENT_URL"],
        json={"event_type": event_type, "data": data},
        headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
        timeout=30,
    )
    response.raise_for_status()


class AskOnce:
    """One chat call on QUESTION (from `env_map`); reward 1 when the reply is not empty."""

    def run(self) -> None:
        client = OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"], max_retries=10)
        reply = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": os.environ["QUESTION"]}], max_tokens=8
        )
        _post("env", {"base_url": os.environ["AGL_OPENAI_BASE_URL"]})
        _post("reward", {"value": 1.0 if reply.choices[0].message.content else 0.0})
