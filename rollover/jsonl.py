"""JSON Lines files as Rollover reads them: one JSON value a line, blank lines skipped, and
every error naming the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_values(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, value) for every non-blank line; `where` is `path:line` for the caller's errors."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from None
            yield where, value
