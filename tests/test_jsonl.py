"""JSON Lines reading shared by the datasets, the warm-up chats and the planner's durations."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollover.jsonl import jsonl_values


def test_blank_lines_are_skipped_and_each_value_says_where_it_is(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n  \n[2]\n')
    assert list(jsonl_values(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:4", [2])]


def test_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid JSON"):
        list(jsonl_values(path))
