"""The vision calc agent, written as an Agent Lightning user writes one: the plain OpenAI client
with an image content part, the reward posted to the events URL, and nothing of Rollover
imported. It reads the contract every Agent Lightning runner sets (`AGL_OPENAI_BASE_URL`,
`AGL_EVENT_URL`, `AGL_KEY`), so it runs unchanged under either.
"""

from __future__ import annotations

import os
import zlib

import httpx
from openai import OpenAI

from examples.vision_calc.task import SYSTEM_PROMPT, calculate, score, user_message

MAX_TURNS = 3
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"


class VisionCalcAgent:
    def run(self, task: dict) -> None:
        base_url, key = os.environ["AGL_OPENAI_BASE_URL"], os.environ["AGL_KEY"]
        # The gateway answers 429 with Retry-After while the trainer updates: the SDK waits it out.
        client = OpenAI(base_url=base_url, api_key=key, max_retries=20)
        held_out = "/mode/val/" in base_url
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(task["expression"])]
        final = ""
        for turn in range(MAX_TURNS):
            # Held-out evaluations sample each task's turns from one stream (common random numbers).
            seed = zlib.crc32(f"{task['id']}:{turn}".encode()) if held_out else None
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=24, seed=seed)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            if "ANSWER:" in text:
                final = text
                break
            start, end = text.find(CALL_OPEN), text.find(CALL_CLOSE)
            if start < 0 or end < start:
                break
            try:
                result = str(calculate(text[start + len(CALL_OPEN) : end]))
            except (ValueError, SyntaxError, RecursionError):
                result = "error"
            messages.append({"role": "tool", "content": result})
        reward = {"event_type": "reward", "data": {"value": score(task, final)}}
        httpx.post(os.environ["AGL_EVENT_URL"], json=reward, headers={"Authorization": f"Bearer {key}"}, timeout=60)
