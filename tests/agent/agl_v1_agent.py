"""An agent written for Agent Lightning v1.0's env contract, with no Rollover import."""

import os

import httpx
from openai import OpenAI

client = OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"], max_retries=10)
reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "2+2?"}])
assert reply.choices[0].message.content
response = httpx.post(
    os.environ["AGL_EVENT_URL"],
    json={"event_type": "reward", "data": {"value": 1.0}},
    headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
)
response.raise_for_status()
