"""The gsm8k agent: one or two chat turns with the policy, then a verified reward.

Turn 1 asks for reasoning that ends with `#### NUMBER`. If the reply has no final answer,
turn 2 asks for the final line only. The reward is 1.0 when the final answer is right.

ROLLOVER_GSM_MAX_TOKENS caps each reply (default 256); agents see it when the config sets it
(agentlightning.local.env.ROLLOVER_GSM_MAX_TOKENS).
"""

from __future__ import annotations

import os

import openai

from examples.gsm8k.task import FOLLOW_UP, SYSTEM_PROMPT, extract_answer, score
from rollover.agent import AgentContext


def max_tokens() -> int:
    return int(os.environ.get("ROLLOVER_GSM_MAX_TOKENS", "256"))


class GSM8KAgent:
    def run(self, task: dict) -> None:
        ctx = AgentContext.from_env()
        client = ctx.openai()
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
        replies: list[str] = []
        for turn in range(2):
            try:
                reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens())
            except openai.BadRequestError as exc:  # e.g. the conversation outgrew the context
                print(f"policy call refused: {exc}", flush=True)
                break
            text = reply.choices[0].message.content or ""
            replies.append(text)
            if extract_answer(text) is not None:
                break
            if turn == 0:
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
        final = replies[-1] if replies else ""
        reward = score(task, final)
        print(
            f"task {task.get('id')}: answer {extract_answer(final)!r}, gold {task['answer']!r}, reward {reward}",
            flush=True,
        )
        ctx.report_reward(reward)
