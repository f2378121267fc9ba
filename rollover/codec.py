"""JSON as the gateway and the store read and write it: orjson, strict standard JSON.

Strict means a body with NaN, Infinity, a number too large for a double or a lone surrogate
is not JSON (it could not be served back as standard JSON), and a value nested deeper than
orjson writes (`MAX_DEPTH`) is refused when it is encoded, before anything is stored.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_DEPTH = 254  # orjson encodes at most this many nested arrays/objects


class JSONCodecError(ValueError):
    """Bytes that are not strict JSON, or a value that cannot be written as JSON."""


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise JSONCodecError(str(exc)) from None


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
