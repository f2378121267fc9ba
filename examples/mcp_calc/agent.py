"""An agent built with the OpenAI Agents SDK and an MCP tool server, written for Agent
Lightning v1.0's env contract: it imports nothing from Rollover and reads only AGL_* and its
own QUESTION/ANSWER variables (the config's `env_map`).

It asks the policy a word problem, lets it call the MCP server's `calculate` tool, and
reports reward 1 when the final answer holds the right number.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import AgentsException
from agents.mcp import MCPServerStdio
from openai import AsyncOpenAI, OpenAIError

SERVER = Path(__file__).with_name("calc_server.py")
INSTRUCTIONS = "Solve the problem. Use the calculate tool for arithmetic, then state the result."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(final_output: str, expected: str) -> float:
    numbers = NUMBER.findall(final_output)
    return 1.0 if numbers and float(numbers[-1]) == float(expected) else 0.0


class CalcAgent:
    async def run(self) -> None:
        set_tracing_disabled(True)  # traces would go to the OpenAI platform
        # The OpenAI client retries 429s on its own: enough to ride out a paused trainer.
        client = AsyncOpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"], max_retries=6)
        server = MCPServerStdio(params={"command": sys.executable, "args": [str(SERVER)]}, cache_tools_list=True)
        final = ""
        async with server:
            agent = Agent(
                name="calc",
                instructions=INSTRUCTIONS,
                mcp_servers=[server],
                model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                model_settings=ModelSettings(max_tokens=64),
            )
            try:
                result = await Runner.run(agent, os.environ["QUESTION"], max_turns=4)
                final = str(result.final_output)
            except AgentsException as exc:  # a malformed tool call, too many turns: no reward
                print(f"agent stopped: {exc!r}", file=sys.stderr)
            except OpenAIError as exc:
                print(f"model call failed: {exc!r}", file=sys.stderr)
                raise
        reward = score(final, os.environ["ANSWER"])
        response = httpx.post(
            os.environ["AGL_EVENT_URL"],
            json={"event_type": "reward", "data": {"value": reward}},
            headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
            timeout=30,
        )
        response.raise_for_status()
