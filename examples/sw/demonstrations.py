"""Demonstrations for the ScienceWorld example's supervised warm-up, played in the simulator.

Each is the conversation the agent itself would have had (its system prompt, worked example,
observations trimmed and the conversation windowed as in `SWAgent`) while replaying a task's
short solution (`short_solution`, made from the simulator's gold path):

    user:      Task: Your task is to find a(n) animal. ... This room is called the hallway. ...
    assistant: ACTION: teleport to outside
    user:      You teleport to the outside.
    assistant: ACTION: look around
    ...        focus on, pick up, teleport to the box's room, move it to the box

A prose demonstration (`prose=True`) says each action as "I will <action>." instead: the same
plan, but the agent reads no `ACTION:` in it and looks around each turn, so the task is never
done. The warmed-up policy knows the plan and is unsure of the protocol, which RL must learn
from the reward alone (as in the calc, gsm8k and smith examples).
"""

from __future__ import annotations

import random
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from examples.sw.agent import KEEP, Settings, opening, window
from examples.sw.task import (
    REUSED_JVM_OPTIONS,
    ScienceWorld,
    action_reply,
    parse_action,
    play,
    prose_reply,
    short_solution,
)

Message = dict[str, str]


def transcript(world: ScienceWorld, task: dict[str, Any], prose: bool, settings: Settings) -> tuple[list[Message], int]:
    """(the agent's conversation, the final score) of one replayed short solution."""
    gold = world.solution(task["task_name"], int(task["variation"]))
    actions = list(reversed(short_solution(gold, world.env.get_task_description())))
    messages: list[Message] = opening()

    def choose(observation: str) -> str | None:
        messages.append({"role": "user", "content": observation})
        if not actions:
            return None
        action = actions.pop()
        reply = prose_reply(action) if prose else action_reply(action)
        messages.append({"role": "assistant", "content": reply})
        return parse_action(reply)

    episode = play(world, task, choose, settings.max_steps, settings.obs_chars)
    while messages[-1]["role"] != "assistant":
        messages.pop()
    return window(messages, settings.prompt_chars, KEEP), episode.score


def _transcripts_of(jobs: list[tuple[dict[str, Any], bool]]) -> list[tuple[list[Message], int]]:
    settings = Settings.from_env()
    with ScienceWorld(step_limit=settings.max_steps + 1, jvm_options=REUSED_JVM_OPTIONS) as world:
        return [transcript(world, task, prose, settings) for task, prose in jobs]


def transcripts(
    tasks: list[dict[str, Any]], prose_fraction: float, seed: int = 0, processes: int = 2
) -> list[tuple[list[Message], int]]:
    """One demonstration per task, `prose_fraction` of them (seeded) in prose; played by
    `processes` simulators side by side, returned in the tasks' order."""
    rng = random.Random(seed)
    jobs = [(task, rng.random() < prose_fraction) for task in tasks]
    shares = [jobs[i::processes] for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        played = list(pool.map(_transcripts_of, shares))
    ordered: list[tuple[list[Message], int]] = [([], 0)] * len(jobs)
    for i, share in enumerate(played):
        ordered[i::processes] = share
    return ordered
