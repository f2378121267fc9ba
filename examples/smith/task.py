"""The smith task: small Python repos with one injected bug, SWE-smith style.

Each repo template is a module plus a passing test file. A bug is a seeded mutation of one
expression or statement in the module (`MUTATIONS`: flip a comparison, off-by-one, wrong
operator, swapped arguments, dropped return). Generation runs the tests in the sandbox and
keeps only bugs that make at least one test fail (and that compile).

A task (one JSON object per line in the data files):
  id             "smith-<template>-<n>"
  files          {path: content} of the buggy repo (module and tests)
  test_files     paths the agent may not change
  failing_tests  ["test_x.py::test_name", ...] that fail with the bug
  mutation       {kind, path, line, description}
  fix            {path, old, new}: the reference fix, a search/replace of the mutated lines
"""

from __future__ import annotations

import ast
import random
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.smith.sandbox import Limits, TestReport, run_tests

# -- repo templates ------------------------------------------------------------------------------

STRUTILS = '''\
"""Small string helpers."""


def reverse_words(text):
    words = text.split()
    return " ".join(reversed(words))


def is_palindrome(text):
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def truncate(text, width, suffix="..."):
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix


def count_vowels(text):
    count = 0
    for char in text.lower():
        if char in "aeiou":
            count += 1
    return count


def chunk(text, size):
    if size < 1:
        raise ValueError("size must be positive")
    return [text[i : i + size] for i in range(0, len(text), size)]


def pad_left(text, width, fill=" "):
    missing = width - len(text)
    if missing > 0:
        return fill * missing + text
    return text
'''

TEST_STRUTILS = """\
from strutils import chunk, count_vowels, is_palindrome, pad_left, reverse_words, truncate


def test_reverse_words():
    assert reverse_words("one two three") == "three two one"
    assert reverse_words("single") == "single"


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("python")


def test_truncate():
    assert truncate("hello", 10) == "hello"
    assert truncate("hello", 5) == "hello"
    assert truncate("hello world", 8) == "hello..."


def test_count_vowels():
    assert count_vowels("Programming") == 3
    assert count_vowels("xyz") == 0


def test_chunk():
    assert chunk("abcdefg", 3) == ["abc", "def", "g"]
    assert chunk("", 2) == []


def test_pad_left():
    assert pad_left("7", 3, "0") == "007"
    assert pad_left("1234", 3) == "1234"
"""

STACK = '''\
"""A stack and a bracket checker built on it."""


class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if len(self._items) == 0:
            raise IndexError("pop from empty stack")
        return self._items.pop()

    def peek(self):
        if self.is_empty():
            return None
        return self._items[-1]

    def is_empty(self):
        return len(self._items) == 0

    def __len__(self):
        return len(self._items)


PAIRS = {")": "(", "]": "[", "}": "{"}


def balanced(text):
    stack = Stack()
    for char in text:
        if char in "([{":
            stack.push(char)
        elif char in PAIRS:
            if stack.is_empty() or stack.pop() != PAIRS[char]:
                return False
    return stack.is_empty()


def max_depth(text):
    depth = 0
    deepest = 0
    for char in text:
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    return deepest
'''

TEST_STACK = """\
from stack import Stack, balanced, max_depth


def test_push_pop():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2
    assert s.pop() == 1
    assert len(s) == 0


def test_pop_empty_raises():
    s = Stack()
    try:
        s.pop()
    except IndexError:
        return
    raise AssertionError("pop on an empty stack must raise IndexError")


def test_peek():
    s = Stack()
    assert s.peek() is None
    s.push("a")
    assert s.peek() == "a"
    assert len(s) == 1


def test_is_empty():
    s = Stack()
    assert s.is_empty()
    s.push(0)
    assert not s.is_empty()


def test_balanced():
    assert balanced("([]{})")
    assert not balanced("(]")
    assert not balanced("((")
    assert balanced("")


def test_max_depth():
    assert max_depth("(()(()))") == 3
    assert max_depth("") == 0
"""

INTERVALS = '''\
"""Date and interval helpers."""

import datetime


def days_between(start, end):
    return (end - start).days


def add_days(day, count):
    return day + datetime.timedelta(days=count)


def is_weekend(day):
    return day.weekday() >= 5


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def merge(intervals):
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(result[-1][1], end))
        else:
            result.append((start, end))
    return result


def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
'''

TEST_INTERVALS = """\
import datetime

from intervals import add_days, clamp, days_between, is_weekend, merge, overlaps


def test_days_between():
    assert days_between(datetime.date(2024, 2, 27), datetime.date(2024, 3, 1)) == 3


def test_add_days():
    assert add_days(datetime.date(2023, 12, 30), 3) == datetime.date(2024, 1, 2)


def test_is_weekend():
    assert is_weekend(datetime.date(2024, 6, 1))
    assert is_weekend(datetime.date(2024, 6, 2))
    assert not is_weekend(datetime.date(2024, 6, 3))


def test_overlaps():
    assert overlaps((1, 5), (4, 8))
    assert not overlaps((1, 5), (5, 8))
    assert not overlaps((6, 9), (1, 3))


def test_merge():
    assert merge([(5, 7), (1, 3), (2, 4)]) == [(1, 4), (5, 7)]
    assert merge([(1, 2), (2, 3)]) == [(1, 3)]
    assert merge([]) == []


def test_clamp():
    assert clamp(5, 0, 10) == 5
    assert clamp(-1, 0, 10) == 0
    assert clamp(11, 0, 10) == 10
"""


@dataclass(frozen=True)
class RepoTemplate:
    name: str
    module_path: str
    files: dict[str, str]

    @property
    def test_files(self) -> list[str]:
        return sorted(p for p in self.files if Path(p).name.startswith("test_"))


TEMPLATES = (
    RepoTemplate("strutils", "strutils.py", {"strutils.py": STRUTILS, "test_strutils.py": TEST_STRUTILS}),
    RepoTemplate("stack", "stack.py", {"stack.py": STACK, "test_stack.py": TEST_STACK}),
    RepoTemplate("intervals", "intervals.py", {"intervals.py": INTERVALS, "test_intervals.py": TEST_INTERVALS}),
)

# -- mutations ----------------------------------------------------------------------------------
# A mutation replaces one small span of the module's text, so the bug is a minimal diff.

_COMPARE_TEXT: dict[type, str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
_FLIPPED: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_OPERATOR_TEXT: dict[type, str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.And: "and",
    ast.Or: "or",
}
_WRONG_OPERATOR: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.And: ast.Or,
    ast.Or: ast.And,
}

Span = tuple[int, int, int, int]  # (line, column, end line, end column), as in `ast`


@dataclass(frozen=True)
class Mutation:
    kind: str
    span: Span
    original: str  # the text of the span
    replacement: str

    @property
    def line(self) -> int:
        return self.span[0]


class _Source:
    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)

    def offset(self, line: int, column: int) -> int:
        """Character offset of (1-based line, UTF-8 byte column)."""
        before = sum(len(text) for text in self.lines[: line - 1])
        return before + len(self.lines[line - 1].encode()[:column].decode())

    def segment(self, span: Span) -> str:
        return self.text[self.offset(span[0], span[1]) : self.offset(span[2], span[3])]

    def mutation(self, kind: str, span: Span, replacement: str) -> Mutation:
        return Mutation(kind, span, self.segment(span), replacement)


def _start(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]


def _between(source: _Source, left: ast.AST, right: ast.AST, old: str, new: str, kind: str) -> Iterator[Mutation]:
    """Replace the operator `old` written between two operands with `new`."""
    span = (*_end(left), *_start(right))
    text = source.segment(span)
    if "#" not in text and re.fullmatch(rf"[\s()]*{re.escape(old)}[\s()]*", text):
        yield source.mutation(kind, span, text.replace(old, new, 1))


def _flip_comparison(node: ast.AST, source: _Source) -> Iterator[Mutation]:
    if isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIPPED:
        op = type(node.ops[0])
        yield from _between(
            source, node.left, node.comparators[0], _COMPARE_TEXT[op], _COMPARE_TEXT[_FLIPPED[op]], "flip_comparison"
        )


def _off_by_one(node: ast.AST, source: _Source) -> Iterator[Mutation]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        for delta in (1, -1):
            yield source.mutation("off_by_one", (*_start(node), *_end(node)), str(node.value + delta))


def _wrong_operator(node: ast.AST, source: _Source) -> Iterator[Mutation]:
    if isinstance(node, ast.BinOp) and type(node.op) in _WRONG_OPERATOR:
        old, new = _OPERATOR_TEXT[type(node.op)], _OPERATOR_TEXT[_WRONG_OPERATOR[type(node.op)]]
        yield from _between(source, node.left, node.right, old, new, "wrong_operator")
    if isinstance(node, ast.BoolOp) and type(node.op) in _WRONG_OPERATOR:
        old, new = _OPERATOR_TEXT[type(node.op)], _OPERATOR_TEXT[_WRONG_OPERATOR[type(node.op)]]
        yield from _between(source, node.values[0], node.values[1], old, new, "wrong_operator")


def _swapped_arguments(node: ast.AST, source: _Source) -> Iterator[Mutation]:
    if (
        isinstance(node, ast.Call)
        and len(node.args) >= 2
        and not any(isinstance(a, ast.Starred) for a in node.args[:2])
    ):
        first, second = node.args[0], node.args[1]
        middle = source.segment((*_end(first), *_start(second)))
        if "#" not in middle and "\n" not in middle:
            swapped = (
                source.segment((*_start(second), *_end(second)))
                + middle
                + source.segment((*_start(first), *_end(first)))
            )
            yield source.mutation("swapped_arguments", (*_start(first), *_end(second)), swapped)


def _dropped_return(node: ast.AST, source: _Source) -> Iterator[Mutation]:
    if isinstance(node, ast.Return) and node.value is not None:
        yield source.mutation("dropped_return", (*_start(node), *_start(node.value)), "")


MUTATIONS: tuple[Callable[[ast.AST, _Source], Iterator[Mutation]], ...] = (
    _flip_comparison,
    _off_by_one,
    _wrong_operator,
    _swapped_arguments,
    _dropped_return,
)


def candidate_mutations(text: str) -> list[Mutation]:
    """Every single-span mutation of a module's source, in source order."""
    source = _Source(text)
    found = [m for node in ast.walk(ast.parse(text)) for mutate in MUTATIONS for m in mutate(node, source)]
    return sorted((m for m in found if m.replacement != m.original), key=lambda m: (m.span, m.kind, m.replacement))


def apply_mutation(text: str, mutation: Mutation) -> tuple[str, dict[str, str]]:
    """The mutated source, and the reference fix: the mutated lines → the original lines."""
    source = _Source(text)
    line, column, end_line, end_column = mutation.span
    start, end = source.offset(line, column), source.offset(end_line, end_column)
    mutated = text[:start] + mutation.replacement + text[end:]
    # The changed lines start on the same line and span as many lines as the replacement.
    first = line - 1
    changed = mutated.splitlines(keepends=True)[first : first + mutation.replacement.count("\n") + 1]
    return mutated, {"old": "".join(changed), "new": "".join(source.lines[first:end_line])}


def apply_fix(files: dict[str, str], fix: dict[str, str]) -> dict[str, str]:
    content = files[fix["path"]]
    if content.count(fix["old"]) != 1:
        raise ValueError(f"the fix's old text must occur exactly once in {fix['path']}")
    return {**files, fix["path"]: content.replace(fix["old"], fix["new"])}


def write_repo(root: str | Path, files: dict[str, str]) -> Path:
    root = Path(root)
    for path, content in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    return root


def check_repo(files: dict[str, str], limits: Limits = Limits()) -> TestReport:
    """Run a repo's tests in a throwaway folder."""
    with tempfile.TemporaryDirectory(prefix="smith-check-") as tmp:
        return run_tests(write_repo(tmp, files), limits)


# -- tasks ------------------------------------------------------------------------------------------


def make_tasks(count: int, seed: int, templates: tuple[RepoTemplate, ...] = TEMPLATES) -> list[dict[str, Any]]:
    """`count` tasks, spread round-robin over the templates: for each, a seeded shuffle of its
    candidate mutations, keeping those that compile, change behaviour and break a test."""
    rng = random.Random(seed)
    queues: list[tuple[RepoTemplate, list[Mutation]]] = []
    for template in templates:
        source = template.files[template.module_path]
        candidates = candidate_mutations(source)
        rng.shuffle(candidates)
        queues.append((template, candidates))
    tasks: list[dict[str, Any]] = []
    while len(tasks) < count and any(candidates for _, candidates in queues):
        for template, candidates in queues:
            while candidates and len(tasks) < count:
                task = _try_mutation(template, candidates.pop(), index=len(tasks))
                if task is not None:
                    tasks.append(task)
                    break
    return tasks


def _try_mutation(template: RepoTemplate, mutation: Mutation, index: int) -> dict[str, Any] | None:
    source = template.files[template.module_path]
    mutated, fix = apply_mutation(source, mutation)
    try:
        compile(mutated, template.module_path, "exec")
    except SyntaxError:
        return None
    if mutated.count(fix["old"]) != 1:
        return None
    files = {**template.files, template.module_path: mutated}
    report = check_repo(files)
    if report.timed_out or report.error is not None or not report.failed:
        return None  # a bug must be a plain test failure, not a hang
    return {
        "id": f"smith-{template.name}-{index}",
        "repo": template.name,
        "files": files,
        "test_files": template.test_files,
        "failing_tests": sorted(report.failed),
        "mutation": {
            "kind": mutation.kind,
            "path": template.module_path,
            "line": mutation.line,
            "description": f"{fix['new'].strip()}  ->  {fix['old'].strip()}",
        },
        "fix": {"path": template.module_path, **fix},
    }
