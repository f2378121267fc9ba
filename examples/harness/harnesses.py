"""The two harnesses, run unchanged: Claude Code's CLI in print mode, and an OpenAI Agents SDK
agent with its default (Responses API) model. Each finds the policy through the standard
variables alone (`ANTHROPIC_BASE_URL`/`ANTHROPIC_API_KEY`, `OPENAI_BASE_URL`/`OPENAI_API_KEY`),
which Rollover's controller sets for every agent; nothing here names Rollover."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

from examples.harness.task import NOTES, prompt, write_notes

ROOT = Path(__file__).resolve().parents[2]
# What the Agents SDK agent is told; Claude Code brings its own system prompt.
INSTRUCTIONS = "You answer questions about files. Use the read_file tool, then answer briefly."
# Where each Claude Code run sees its own folder (see `run_claude_code`).
CLAUDE_MOUNT = Path("/tmp/rollover-harness")


def claude_binary() -> str:
    """Claude Code's CLI: $ROLLOVER_CLAUDE, the copy `scripts/setup.sh --dev` installs, or PATH."""
    for candidate in (os.environ.get("ROLLOVER_CLAUDE"), str(ROOT / ".harnesses/node_modules/.bin/claude")):
        if candidate and Path(candidate).exists():
            return candidate
    found = shutil.which("claude")
    if found is None:
        raise FileNotFoundError("Claude Code's CLI is not installed: run scripts/setup.sh --dev (npm)")
    return found


def run_claude_code(
    folder: Path, task: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Claude Code in print mode on `task`: `claude -p PROMPT --model policy --allowedTools Read`,
    the task's notes in `folder`, the standard variables from `env` (default: this process's).

    Claude Code writes its working folder and home into its system prompt, so each run sees
    its own `folder` at one fixed place, `CLAUDE_MOUNT` (home inside it), in a mount namespace
    of its own (`unshare`, unprivileged): every rollout's prompt is the same up to its task, and
    the engine's prefix cache holds across rollouts."""
    write_notes(folder, task)
    (folder / ".home").mkdir(exist_ok=True)
    CLAUDE_MOUNT.mkdir(parents=True, exist_ok=True)
    variables = dict(os.environ if env is None else env)
    variables["HOME"] = str(CLAUDE_MOUNT / ".home")
    claude = [claude_binary(), "-p", prompt(CLAUDE_MOUNT / NOTES), "--model", "policy", "--allowedTools", "Read"]
    mount = 'mount --bind "$0" "$1" && cd "$1" && shift && exec "$@"'
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(folder), str(CLAUDE_MOUNT), *claude],
        env=variables,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


async def run_agents_sdk(folder: Path, task: dict[str, Any], max_turns: int = 4, run_config: Any = None) -> str:
    """The Agents SDK agent on `task` (its notes written in `folder`), with one function tool that
    reads the folder's files, and its default model: the Responses API through
    `OPENAI_BASE_URL`/`OPENAI_API_KEY` (`run_config`, the SDK's run settings: None for its
    defaults). Returns its final output."""
    from agents import Agent, ModelSettings, Runner, function_tool

    write_notes(folder, task)

    @function_tool
    def read_file(path: str) -> str:
        """Read a text file of the working folder and return its contents."""
        try:
            return (folder / path).read_text()
        except OSError as exc:
            return f"error: {exc}"

    agent = Agent(
        name="reader",
        instructions=INSTRUCTIONS,
        tools=[read_file],
        model="policy",
        model_settings=ModelSettings(max_tokens=64),
    )
    result = await Runner.run(agent, prompt(NOTES), max_turns=max_turns, run_config=run_config)
    return str(result.final_output)


def run_agents_sdk_sync(folder: Path, task: dict[str, Any], env: dict[str, str]) -> str:
    """`run_agents_sdk` with the standard variables of `env` (in this process, for the capture)."""
    with mock.patch.dict(os.environ, env):
        return asyncio.run(_run_agents_sdk_once(folder, task))


async def _run_agents_sdk_once(folder: Path, task: dict[str, Any]) -> str:
    """`run_agents_sdk` with a client of this event loop's own: the SDK's default shares one
    HTTP client per process, whose pooled connections die with the first loop that used them
    (a second capture in one process then fails with "Event loop is closed"). The client reads
    the same variables the default does."""
    from agents import OpenAIProvider, RunConfig
    from openai import AsyncOpenAI

    async with AsyncOpenAI() as client:
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
        return await run_agents_sdk(folder, task, run_config=config)
