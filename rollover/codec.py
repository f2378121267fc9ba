"""JSON as the gateway and the store read and write it: orjson, strict standard JSON.

Strict means a body with NaN, Infinity, a number too large for a double or a lone surrogate
is not JSON (it could not be served back as standard JSON), and a value nested deeper than
orjson writes (`MAX_DEPTH`) is refused when it is encoded, before anything is stored. The
gateway refuses deeper bodies already when it parses them (`loads(max_depth=...)`,
`gateway.max_json_depth`), so whatever it accepts can be stored and served back.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_DEPTH = 254  # orjson encodes at most this many nested arrays/objects


class JSONCodecError(ValueError):
    """Bytes that are not strict JSON, or a value that cannot be written as JSON."""


def loads(data: bytes | bytearray | memoryview | str, max_depth: int | None = None) -> Any:
    """Strict JSON; with `max_depth`, a value nested deeper than that is refused too."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
        if reason.startswith("depth limit exceeded"):  # orjson's own limit, 1024
            reason = f"nested deeper than {max_depth or 1024} levels"
        raise JSONCodecError(reason) from None
    if max_depth is not None and _deeper_than(data, max_depth):
        raise JSONCodecError(f"nested deeper than {max_depth} levels")
    return value


_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _deeper_than(raw: bytes | bytearray | memoryview | str, limit: int) -> bool:
    """Whether valid JSON `raw` nests deeper than `limit`, at C speed (bytes methods, no
    Python loop over the value): its brackets outside strings, emptied of their innermost
    pairs one level at a time."""
    text = raw.encode() if isinstance(raw, str) else bytes(raw)
    if text.count(b"[") + text.count(b"{") <= limit:  # cannot be deeper: the usual case
        return False
    # Outside strings: escapes dropped (a backslash only ever starts one, read left to right),
    # then every other piece between quotes.
    unescaped = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        brackets = brackets.replace(b"x", b"")
        if not brackets:
            return False
        # One level: the empty pairs become "x", which keeps a pair around them from
        # looking empty until the next round.
        brackets = brackets.replace(b"[]", b"x").replace(b"{}", b"x")
    return bool(brackets.replace(b"x", b""))


def loads_lenient(data: bytes | str) -> Any:
    """Like `loads`, but also takes the NaN and Infinity that Python-made JSON may carry (an
    engine's logprobs; a store file written before the codec was strict)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise JSONCodecError(str(exc)) from None


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON; NaN and Infinity are written as null (orjson's rule)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        reason = str(exc)
        if "Recursion limit" in reason:
            reason = f"nested deeper than {MAX_DEPTH} levels"
        raise JSONCodecError(reason) from None


def dumps_str(value: Any) -> str:
    return dumps(value).decode()
