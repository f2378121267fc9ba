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
  n_tests        how many tests the repo has (all pass once fixed)
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

STATS = '''\
"""Summary statistics of a list of numbers."""


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def spread(values):
    return max(values) - min(values)


def count_above(values, limit):
    count = 0
    for value in values:
        if value > limit:
            count += 1
    return count


def running_total(values):
    totals = []
    total = 0
    for value in values:
        total += value
        totals.append(total)
    return totals
'''

TEST_STATS = """\
from stats import count_above, mean, median, running_total, spread


def test_mean():
    assert mean([1, 2, 3, 6]) == 3
    assert mean([5]) == 5


def test_mean_empty_raises():
    try:
        mean([])
    except ValueError:
        return
    raise AssertionError("mean of an empty list must raise ValueError")


def test_median():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert median([7, 9]) == 8


def test_spread():
    assert spread([4, 9, 1]) == 8


def test_count_above():
    assert count_above([1, 5, 7, 5], 5) == 1
    assert count_above([], 0) == 0


def test_running_total():
    assert running_total([1, 2, 3]) == [1, 3, 6]
    assert running_total([]) == []
"""

ROMAN = '''\
"""Roman numerals."""

NUMERALS = [
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
]


def to_roman(number):
    if number < 1 or number > 3999:
        raise ValueError("out of range")
    parts = []
    for value, letters in NUMERALS:
        while number >= value:
            parts.append(letters)
            number -= value
    return "".join(parts)


def from_roman(text):
    values = {letters: value for value, letters in NUMERALS if len(letters) == 1}
    total = 0
    for i, char in enumerate(text):
        value = values[char]
        if i + 1 < len(text) and values[text[i + 1]] > value:
            total -= value
        else:
            total += value
    return total
'''

TEST_ROMAN = """\
from roman import from_roman, to_roman


def test_to_roman():
    assert to_roman(1) == "I"
    assert to_roman(4) == "IV"
    assert to_roman(9) == "IX"
    assert to_roman(14) == "XIV"
    assert to_roman(40) == "XL"
    assert to_roman(90) == "XC"
    assert to_roman(400) == "CD"
    assert to_roman(1994) == "MCMXCIV"
    assert to_roman(3999) == "MMMCMXCIX"


def test_to_roman_range():
    for bad in (0, 4000):
        try:
            to_roman(bad)
        except ValueError:
            continue
        raise AssertionError(f"to_roman({bad}) must raise ValueError")


def test_from_roman():
    assert from_roman("III") == 3
    assert from_roman("XLII") == 42
    assert from_roman("MCMXCIV") == 1994


def test_large_numbers():
    assert to_roman(2024) == "MMXXIV"
    assert from_roman("MMMDCCCLXXXVIII") == 3888


def test_round_trip():
    for number in range(1, 200):
        assert from_roman(to_roman(number)) == number
"""

BANK = '''\
"""A bank account with a transaction log."""


class Account:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(("withdraw", amount))

    def add_interest(self, percent):
        interest = self.balance * percent // 100
        self.balance += interest
        return interest


def transfer(source, target, amount):
    source.withdraw(amount)
    target.deposit(amount)
    return source.balance, target.balance
'''

TEST_BANK = """\
from bank import Account, transfer


def test_deposit():
    account = Account("ann")
    account.deposit(50)
    assert account.balance == 50
    assert account.history == [("deposit", 50)]


def test_deposit_must_be_positive():
    account = Account("ann")
    for bad in (0, -5):
        try:
            account.deposit(bad)
        except ValueError:
            continue
        raise AssertionError("a non-positive deposit must raise ValueError")


def test_withdraw():
    account = Account("bob", 100)
    account.withdraw(30)
    account.withdraw(70)
    assert account.balance == 0
    assert account.history == [("withdraw", 30), ("withdraw", 70)]


def test_overdraft_raises():
    account = Account("bob", 10)
    try:
        account.withdraw(11)
    except ValueError:
        assert account.balance == 10
        return
    raise AssertionError("overdraft must raise ValueError")


def test_add_interest():
    account = Account("cy", 250)
    assert account.add_interest(10) == 25
    assert account.balance == 275


def test_transfer():
    a, b = Account("a", 80), Account("b", 5)
    assert transfer(a, b, 30) == (50, 35)
"""

GRID = '''\
"""A small grid of cells."""


def make_grid(rows, cols, fill=0):
    return [[fill] * cols for _ in range(rows)]


def in_bounds(grid, row, col):
    return 0 <= row < len(grid) and 0 <= col < len(grid[0])


def neighbours(grid, row, col):
    result = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        r, c = row + dr, col + dc
        if in_bounds(grid, r, c):
            result.append((r, c))
    return result


def transpose(grid):
    return [[grid[r][c] for r in range(len(grid))] for c in range(len(grid[0]))]


def count_cells(grid, value):
    total = 0
    for row in grid:
        total += row.count(value)
    return total


def manhattan(a, b):
    return abs(a[0] - b[0]) + abs(a[1] - b[1])
'''

TEST_GRID = """\
from grid import count_cells, in_bounds, make_grid, manhattan, neighbours, transpose


def test_make_grid():
    grid = make_grid(2, 3)
    assert grid == [[0, 0, 0], [0, 0, 0]]
    grid[0][0] = 1
    assert grid[1][0] == 0


def test_in_bounds():
    grid = make_grid(2, 3)
    assert in_bounds(grid, 0, 0)
    assert in_bounds(grid, 1, 2)
    assert not in_bounds(grid, 2, 0)
    assert not in_bounds(grid, 0, 3)
    assert not in_bounds(grid, -1, 1)


def test_neighbours():
    grid = make_grid(3, 3)
    assert sorted(neighbours(grid, 0, 0)) == [(0, 1), (1, 0)]
    assert len(neighbours(grid, 1, 1)) == 4
    assert sorted(neighbours(grid, 2, 1)) == [(1, 1), (2, 0), (2, 2)]


def test_transpose():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


def test_count_cells():
    assert count_cells([[1, 0], [1, 1]], 1) == 3
    assert count_cells([[0]], 1) == 0


def test_manhattan():
    assert manhattan((1, 2), (4, 0)) == 5
    assert manhattan((3, 3), (3, 3)) == 0
"""

CART = '''\
"""A shopping cart with discounts."""


class Cart:
    def __init__(self):
        self.items = {}

    def add(self, name, price, quantity=1):
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        old_price, old_quantity = self.items.get(name, (price, 0))
        self.items[name] = (price, old_quantity + quantity)

    def remove(self, name):
        if name not in self.items:
            raise KeyError(name)
        del self.items[name]

    def count(self):
        return sum(quantity for _, quantity in self.items.values())

    def subtotal(self):
        return sum(price * quantity for price, quantity in self.items.values())

    def total(self, discount_percent=0):
        subtotal = self.subtotal()
        if subtotal >= 100:
            subtotal -= 5
        return subtotal * (100 - discount_percent) // 100
'''

TEST_CART = """\
from cart import Cart


def test_add_and_count():
    cart = Cart()
    cart.add("pen", 2)
    cart.add("pen", 2, 3)
    cart.add("ink", 7)
    assert cart.count() == 5
    assert cart.items["pen"] == (2, 4)


def test_add_rejects_zero_quantity():
    cart = Cart()
    try:
        cart.add("pen", 2, 0)
    except ValueError:
        return
    raise AssertionError("quantity 0 must raise ValueError")


def test_remove():
    cart = Cart()
    cart.add("pen", 2)
    cart.remove("pen")
    assert cart.count() == 0
    try:
        cart.remove("pen")
    except KeyError:
        return
    raise AssertionError("removing a missing item must raise KeyError")


def test_subtotal():
    cart = Cart()
    cart.add("pen", 3, 2)
    cart.add("pad", 10)
    assert cart.subtotal() == 16


def test_total():
    cart = Cart()
    cart.add("lamp", 60, 2)
    assert cart.total() == 115
    assert cart.total(10) == 103
    small = Cart()
    small.add("pen", 40)
    assert small.total(50) == 20
    exact = Cart()
    exact.add("pad", 100)
    assert exact.total() == 95
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
    RepoTemplate("stats", "stats.py", {"stats.py": STATS, "test_stats.py": TEST_STATS}),
    RepoTemplate("roman", "roman.py", {"roman.py": ROMAN, "test_roman.py": TEST_ROMAN}),
    RepoTemplate("bank", "bank.py", {"bank.py": BANK, "test_bank.py": TEST_BANK}),
    RepoTemplate("grid", "grid.py", {"grid.py": GRID, "test_grid.py": TEST_GRID}),
    RepoTemplate("cart", "cart.py", {"cart.py": CART, "test_cart.py": TEST_CART}),
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
    queues: list[tuple[RepoTemplate, list[Mutation], int]] = []
    for template in templates:
        source = template.files[template.module_path]
        candidates = candidate_mutations(source)
        rng.shuffle(candidates)
        queues.append((template, candidates, len(check_repo(template.files).passed)))
    tasks: list[dict[str, Any]] = []
    while len(tasks) < count and any(candidates for _, candidates, _ in queues):
        for template, candidates, n_tests in queues:
            while candidates and len(tasks) < count:
                task = _try_mutation(template, candidates.pop(), len(tasks), n_tests)
                if task is not None:
                    tasks.append(task)
                    break
    return tasks


def _try_mutation(template: RepoTemplate, mutation: Mutation, index: int, n_tests: int) -> dict[str, Any] | None:
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
        "n_tests": n_tests,
        "mutation": {
            "kind": mutation.kind,
            "path": template.module_path,
            "line": mutation.line,
            "description": f"{fix['new'].strip()}  ->  {fix['old'].strip()}",
        },
        "fix": {"path": template.module_path, **fix},
    }
