"""The calc task: arithmetic questions answered with a calculator tool (text protocol).

Protocol (documented for agents and for the warm-up data):
  user:      What is 37+45?
  assistant: <calc>37+45</calc>
  tool:      82
  assistant: ANSWER: 82
Reward 1.0 when the final answer equals the true value, else 0.0.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

SYSTEM_PROMPT = (
    "You solve arithmetic with a calculator. Call it as <calc>EXPRESSION</calc>, "
    "read its result, then reply ANSWER: NUMBER."
)
CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
ANSWER = re.compile(r"ANSWER:\s*(-?\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def make_task(rng: random.Random, index: int) -> dict[str, Any]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 19), rng.randint(2, 9)
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    expression = f"{a}{op}{b}"
    return {
        "id": f"calc-{index}",
        "question": f"What is {expression}?",
        "expression": expression,
        "answer": calculate(expression),
    }


def make_tasks(count: int, seed: int, start: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_task(rng, start + i) for i in range(count)]


def calculate(expression: str) -> int:
    """Evaluate + - * over integers; anything else is a ValueError (never eval)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("unsupported expression")

    if len(expression) > 64:
        raise ValueError("expression too long")
    return walk(ast.parse(expression.strip(), mode="eval"))


def score(task: dict[str, Any], final_text: str) -> float:
    match = ANSWER.search(final_text or "")
    return 1.0 if match and int(match.group(1)) == int(task["answer"]) else 0.0


PROSE_ANSWER = "The answer is {}."


def demonstration(task: dict[str, Any], final_format: str = "ANSWER: {}") -> list[dict[str, str]]:
    """A transcript that uses the calculator, used to warm a tiny model up on the protocol.
    With `final_format=PROSE_ANSWER` the arithmetic is right but the reply breaks the
    protocol, so `score` gives it nothing."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": f"<calc>{task['expression']}</calc>"},
        {"role": "tool", "content": str(task["answer"])},
        {"role": "assistant", "content": final_format.format(task["answer"])},
    ]
