"""The calc agent: a real program that talks to the policy through Rollover's gateway.

Its calculator is a slow tool: each call sleeps for a long-tailed (lognormal) time, with the
median and sigma read from ROLLOVER_CALC_LATENCY_MEDIAN / ROLLOVER_CALC_LATENCY_SIGMA
(defaults 0.1 s and 1.0), so rollout durations vary the way real agents' do.

ROLLOVER_CALC_TURN_REWARD (default 0: off) is a reward posted for each turn whose calculator
call is well formed (the expression evaluates), naming that call: a reward per turn, beside the
outcome reward for the answer (README: Rewards per turn).
"""

from __future__ import annotations

import math
import os
import random
import time
import zlib

from examples.calc.task import ANSWER, CALL, SYSTEM_PROMPT, calculate, score
from rollover.agent import AgentContext

MAX_TURNS = 3


def tool_latency(rng: random.Random) -> float:
    median = float(os.environ.get("ROLLOVER_CALC_LATENCY_MEDIAN", "0.1"))
    sigma = float(os.environ.get("ROLLOVER_CALC_LATENCY_SIGMA", "1.0"))
    return min(median * math.exp(sigma * rng.gauss(0, 1)), 60.0)


class CalcAgent:
    def model(self, turn: int) -> str:
        """The model asked for at `turn`: any name, the gateway serves the policy."""
        return "policy"

    def run(self, task: dict) -> None:
        ctx = AgentContext.from_env()
        client = ctx.openai()
        rng = random.Random(ctx.rollout_id)
        turn_reward = float(os.environ.get("ROLLOVER_CALC_TURN_REWARD", "0"))
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
        final = ""
        for turn in range(MAX_TURNS):
            # Held-out evaluations reuse one random stream per task and turn, so two evaluations
            # of different policies differ only where the policies do (common random numbers).
            seed = zlib.crc32(f"{task['id']}:{turn}".encode()) if ctx.mode == "val" else None
            raw = client.chat.completions.with_raw_response.create(
                model=self.model(turn), messages=messages, max_tokens=24, seed=seed
            )
            reply = raw.parse()
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            if ANSWER.search(text):
                final = text
                break
            call = CALL.search(text)
            if call is None:
                break
            time.sleep(tool_latency(rng))
            try:
                result = str(calculate(call.group(1)))
            except (ValueError, SyntaxError, RecursionError):
                result = "error"
            if turn_reward and result != "error":
                ctx.report_reward(turn_reward, call_id=raw.headers.get("x-agl-call-id"))
            messages.append({"role": "tool", "content": result})
        ctx.report_reward(score(task, final))


class TwoRoleCalcAgent(CalcAgent):
    """The calc agent as two policies (`agentlightning.policies: {planner, solver}`): the
    planner takes the first turn (usually the calculator call), the solver every later one
    (usually the answer from the tool's result)."""

    def model(self, turn: int) -> str:
        return "planner" if turn == 0 else "solver"
