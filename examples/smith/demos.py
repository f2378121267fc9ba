"""Demonstrations for the smith example's supervised warm-up, made from a task's known fix.

A protocol-correct demonstration rewrites the buggy module with the fixed source (the task's
`fix` applied: the template's original code), runs the tests and finishes:

    user:      Repository files: ... Failing tests: ... Find and fix the bug.
    assistant: <tool>{"name": "write_file", "args": {"path": "stack.py", "content": "..."}}</tool>
    user:      <result> wrote stack.py </result>
    assistant: <tool>{"name": "run_tests", "args": {}}</tool>
    user:      <result> 6 passed, 0 failed </result>
    assistant: <tool>{"name": "finish", "args": {}}</tool>

A protocol-failing one (`protocol_ok=False`) writes the same call in a ```json markdown block
instead of the `<tool>` tag (a common slip of chat models). The agent takes a reply without a
tool call as its final answer, so the repo is never changed and the reward is 0: the skill
(the fixed code, token for token the same JSON) is the same, only the protocol differs.
"""

from __future__ import annotations

import json
from typing import Any

from examples.smith.agent import SYSTEM_PROMPT, first_message
from examples.smith.task import apply_fix

Message = dict[str, str]


def tool_call(name: str, **args: str) -> str:
    return f"<tool>{json.dumps({'name': name, 'args': args})}</tool>"


def result(text: str) -> str:
    return f"<result>\n{text}\n</result>"


def fixed_module(task: dict[str, Any]) -> tuple[str, str]:
    """(path, content) of the module with the task's reference fix applied."""
    path = task["fix"]["path"]
    return path, apply_fix(task["files"], task["fix"])[path]


def fenced_call(name: str, **args: str) -> str:
    """The same call as `tool_call`, in a ```json block instead of the <tool> tag."""
    return f"```json\n{json.dumps({'name': name, 'args': args})}\n```"


def demonstration(task: dict[str, Any], protocol_ok: bool = True) -> list[Message]:
    path, content = fixed_module(task)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": first_message(task)}]
    if not protocol_ok:
        return [*messages, {"role": "assistant", "content": fenced_call("write_file", path=path, content=content)}]
    return [
        *messages,
        {"role": "assistant", "content": tool_call("write_file", path=path, content=content)},
        {"role": "user", "content": result(f"wrote {path}")},
        {"role": "assistant", "content": tool_call("run_tests")},
        {"role": "user", "content": result(f"{task['n_tests']} passed, 0 failed")},
        {"role": "assistant", "content": tool_call("finish")},
    ]
