"""A generation-dominated agent for the benchmarks: one long model call per rollout, no tool.

It asks the calc task's question and lets the policy write `max_tokens` tokens, drawn per
rollout uniformly between a quarter of ROLLOVER_LONG_ANSWER_TOKENS (default 256) and all of
it, past any end-of-text (`ignore_eos`), so a rollout's time is its generation; the reward is
the calc task's (an `ANSWER: N` anywhere in the reply). What reasoning agents look like to the
trainer: few calls, long answers, lengths that vary.
"""

from __future__ import annotations

import os
import random

from examples.calc.task import SYSTEM_PROMPT, score
from rollover.agent import AgentContext


class LongAnswerAgent:
    def run(self, task: dict) -> None:
        ctx = AgentContext.from_env()
        longest = int(os.environ.get("ROLLOVER_LONG_ANSWER_TOKENS", "256"))
        tokens = random.Random(ctx.rollout_id).randint(max(1, longest // 4), longest)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
        reply = ctx.openai().chat.completions.create(
            model="policy", messages=messages, max_tokens=tokens, extra_body={"ignore_eos": True}
        )
        ctx.report_reward(score(task, reply.choices[0].message.content or ""))
