"""The harness example's task: a file in the agent's working folder holds a secret code; the
agent must read it with its harness's file tool and answer with the code. Reward 1 when the
last four-digit number of the final answer is the code (the file's other numbers are decoys)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

NOTES = "notes.txt"
_FOUR_DIGITS = re.compile(r"(?<!\d)\d{4}(?!\d)")
_TOPICS = ["garden", "harbor", "library", "orbit", "meadow", "lantern", "quartz", "canyon", "pixel", "saddle"]


def make_tasks(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"code": f"{rng.randint(1000, 9999)}", "topic": rng.choice(_TOPICS), "room": rng.randint(10, 99)}
        for _ in range(count)
    ]


def notes_text(task: dict[str, Any]) -> str:
    return f"Notes about the {task['topic']} project.\nMeeting in room {task['room']}.\nThe secret code is {task['code']}.\n"


def prompt(path: Path | str) -> str:
    """What the harness is asked: the file's absolute path is in it (Claude Code's Read takes one)."""
    return f"Read the file {path} and reply with the secret code."


def write_notes(folder: Path, task: dict[str, Any]) -> Path:
    path = folder / NOTES
    path.write_text(notes_text(task))
    return path


def score(answer: str, code: str) -> float:
    found = _FOUR_DIGITS.findall(answer)
    return 1.0 if found and found[-1] == code else 0.0
