"""The gsm8k task: grade-school math word problems, answered in free text.

Problems come from `reasoning-gym`'s `gsm_symbolic` generator (GSM8K templates with fresh
names and numbers), generated offline from a seed.

Protocol (stated in the system prompt):
  user:      <word problem>
  assistant: <step-by-step reasoning>
             #### 42
The final answer is the number after the last `####` (or `ANSWER:`) marker. When the first
reply has no marker, the agent asks once more for the final line only.

Reward: 1.0 when that number equals the true answer (numerically, see `answers_match`),
else 0.0. A reply without a marker scores 0, and so does a final line that states several
different numbers (`#### 2 * 2 = 4`): following the protocol is part of the task.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Any

SYSTEM_PROMPT = (
    "Solve the math word problem. Think step by step, then write the final answer "
    "on its own last line as '#### NUMBER' (a plain number, no units)."
)
FOLLOW_UP = "Write only the final answer, as '#### NUMBER'."

# The final-answer marker and what follows it on the same line.
_MARKER = re.compile(r"(?:####|\bANSWER\s*:)[ \t]*([^\n]*)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_LATEX_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
# A number: optional sign and currency, digits with optional thousands separators, optional
# decimals and exponent, then optionally a mixed or plain fraction, then optionally a percent.
_NUMBER = re.compile(
    r"(?P<sign>[-+])?\s*[$€£]?\s*"
    r"(?:(?P<whole>\d+)\s+(?=\d+\s*/\s*\d))?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?"
    r"\s*(?P<pct>%)?"
)
REL_TOL = 1e-6
ABS_TOL = 1e-9


# -- the verifier -----------------------------------------------------------------------------


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\u2013", "-").replace("\\%", "%").replace("\\$", "$")
    text = _LATEX_FRAC.sub(r"(\1)/(\2)", text)
    text = re.sub(r"\\[,!; ]|\{,\}", "", text)  # LaTeX thin spaces and {,} separators
    return text.replace("(", "").replace(")", "")


def _value(match: re.Match[str]) -> Fraction | None:
    value = Fraction(match["num"].replace(",", ""))
    if match["den"] is not None:
        denominator = Fraction(match["den"])
        if denominator == 0:
            return None
        value /= denominator
    if match["whole"] is not None:
        value += int(match["whole"])
    return -value if match["sign"] == "-" else value


def parse_numbers(text: str) -> list[Fraction]:
    """Every number in `text`, exactly, as Fractions: `$1,234.50` → 2469/2, `-3/4`,
    `1 1/2` → 3/2, `50%` → 50 (the percent sign is dropped, as GSM answers are in percent
    units), `12.` → 12, `\\frac{3}{4}`, `1.5e3`."""
    values = (_value(match) for match in _NUMBER.finditer(_normalise(text or "")))
    return [value for value in values if value is not None]


def parse_number(text: str) -> Fraction | None:
    """The first number in `text` (see `parse_numbers`), None when there is none."""
    values = parse_numbers(text)
    return values[0] if values else None


def parse_answer(text: str) -> Fraction | None:
    """The number a final-answer line states: its numbers must all be equal (`42`, `$42.`,
    `42 (42 apples)`); an expression such as `2 * 2 = 4` states no single answer → None."""
    values = parse_numbers(text)
    return values[0] if values and all(v == values[0] for v in values) else None


def extract_answer(text: str) -> str | None:
    """The text of the final answer: after the last `####`/`ANSWER:` marker that is followed by
    a number, else inside the last `\\boxed{...}`; None when the reply gives no final answer."""
    text = text or ""
    for candidate in reversed(_MARKER.findall(text)):
        if parse_number(candidate) is not None:
            return candidate.strip()
    boxed = _BOXED.findall(text)
    return boxed[-1].strip() if boxed else None


def answers_match(predicted: Fraction | float | int | str | None, gold: Fraction | float | int | str) -> bool:
    """Numeric equality within REL_TOL (relative) or ABS_TOL (absolute); strings are read
    with `parse_answer`."""
    if isinstance(predicted, str):
        predicted = parse_answer(predicted)
    if isinstance(gold, str):
        parsed = parse_answer(gold)
        if parsed is None:
            raise ValueError(f"gold answer {gold!r} is not a number")
        gold = parsed
    if predicted is None:
        return False
    p, g = Fraction(predicted), Fraction(gold)
    return abs(p - g) <= max(ABS_TOL, REL_TOL * abs(g))


def score(task: dict[str, Any], reply: str) -> float:
    answer = extract_answer(reply)
    return 1.0 if answer is not None and answers_match(answer, str(task["answer"])) else 0.0


# -- the data -----------------------------------------------------------------------------------


# Two-step `gsm_symbolic` templates whose worked solutions use small numbers (one product or
# quotient and one sum or difference): a 135M model warmed up on their solutions gets a fair
# share right, so RL starts from a success rate between 0 and 1. `None` = every template.
EASY_TEMPLATES = (6, 24, 31, 39, 48, 50, 58, 69)
PROSE_ANSWER = "The answer is {}."


def _generators(templates: tuple[int, ...]) -> list[Any]:
    from reasoning_gym.arithmetic.gsm_symbolic import generators_00_49, generators_50_99

    return [
        getattr(generators_00_49, f"generate_{t}", None) or getattr(generators_50_99, f"generate_{t}")
        for t in templates
    ]


def generate_problems(count: int, seed: int, templates: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """`count` distinct problems from `gsm_symbolic` (deterministic for a seed), each with its
    worked solution (`solution`, ending in `#### ANSWER`); `templates` restricts the generator
    numbers (see EASY_TEMPLATES)."""
    if templates is not None:
        generators, rng = _generators(templates), random.Random(seed)
        tasks, seen = [], set()
        for attempt in range(100 * count):
            item = generators[attempt % len(generators)](random.Random(rng.getrandbits(64)), 1.0)
            if item["question"] not in seen:
                seen.add(item["question"])
                tasks.append(
                    {
                        "question": item["question"],
                        "answer": str(item["answer"]),
                        "solution": item["metadata"]["answer_cot"],
                    }
                )
            if len(tasks) == count:
                return tasks
        raise ValueError(f"templates {templates} give fewer than {count} distinct problems")

    import reasoning_gym

    tasks = []
    seen = set()
    size = count
    while len(tasks) < count:
        tasks, seen = [], set()
        for item in reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed):
            if item["question"] in seen:
                continue
            seen.add(item["question"])
            tasks.append(
                {
                    "question": item["question"],
                    "answer": str(item["answer"]),
                    "solution": item["metadata"]["answer_cot"],
                }
            )
        size += count - len(tasks)
    return tasks[:count]


def make_splits(
    train_size: int, val_size: int, seed: int, templates: tuple[int, ...] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and val sets: one seeded generation, shuffled, then split, with ids."""
    problems = generate_problems(train_size + val_size, seed, templates)
    random.Random(seed).shuffle(problems)
    for index, problem in enumerate(problems):
        problem["id"] = f"gsm-{seed}-{index}"
    return problems[:train_size], problems[train_size:]


def demonstration(task: dict[str, Any], ending: str = "#### {}") -> list[dict[str, str]]:
    """The chat a solver of `task` would have: its worked solution (when the task has one)
    whose final line is `ending` filled with the answer (`PROSE_ANSWER` gives an ending the
    grader does not accept)."""
    lines = [line for line in str(task.get("solution", "")).splitlines() if not line.startswith("####")]
    reply = "\n".join([*lines, ending.format(task["answer"])]).strip()
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": reply},
    ]
