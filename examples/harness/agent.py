"""The agents the controller runs: each writes its task's notes into a folder of its own, runs
its harness unchanged on it (the harness finds the policy through the standard variables the
controller sets), and reports reward 1 when the final answer gives the file's secret code."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from agents.exceptions import AgentsException

from examples.harness.harnesses import run_agents_sdk, run_claude_code
from examples.harness.task import score
from rollover.agent import AgentContext


class ClaudeCodeAgent:
    """Claude Code's CLI in print mode (`claude -p ... --allowedTools Read`)."""

    def run(self, task: dict) -> None:
        with tempfile.TemporaryDirectory(prefix="harness-") as folder:
            done = run_claude_code(Path(folder), task)
        print(done.stderr[-4000:], file=sys.stderr)
        if done.returncode != 0:  # the harness failed (not the model's answer): the attempt fails
            raise RuntimeError(f"claude exited with {done.returncode}")
        print(f"answer: {done.stdout.strip()!r}")
        AgentContext.from_env().report_reward(score(done.stdout, task["code"]))


class AgentsSdkAgent:
    """An OpenAI Agents SDK agent with a `read_file` function tool (its default Responses model)."""

    async def run(self, task: dict) -> None:
        with tempfile.TemporaryDirectory(prefix="harness-") as folder:
            try:
                final = await run_agents_sdk(Path(folder), task)
            except AgentsException as exc:  # a malformed tool call, too many turns: no reward
                print(f"agent stopped: {exc!r}", file=sys.stderr)
                final = ""
        print(f"answer: {final!r}")
        AgentContext.from_env().report_reward(score(final, task["code"]))
