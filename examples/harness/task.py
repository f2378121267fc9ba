"""The harness example's task: a file in the agent's working folder holds a secret code word;
the agent must read it with its harness's file tool and answer with the code. Reward 1 when the
last code word of the final answer is the file's (the file's topic and room are decoys).

The code is one of `CODES`, so an answer that names a code without reading the file is right
one time in eight: the policy's reward has a signal from its first group, and only reading the
file gets it above chance."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

NOTES = "notes.txt"
CODES = ["otter", "falcon", "badger", "heron", "walrus", "panther", "beetle", "salmon"]
_CODE_WORD = re.compile(r"\b(" + "|".join(CODES) + r")\b", re.IGNORECASE)
TOPICS = ["garden", "harbor", "library", "orbit", "meadow", "lantern", "quartz", "canyon", "pixel", "saddle"]


def make_tasks(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"code": rng.choice(CODES), "topic": rng.choice(TOPICS), "room": rng.randint(10, 99)} for _ in range(count)]


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
    found = _CODE_WORD.findall(answer)
    return 1.0 if found and found[-1].lower() == code else 0.0
