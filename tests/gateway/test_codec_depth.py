"""`codec.loads(max_depth=...)` refuses exactly the values nested deeper than the limit, whatever
brackets, quotes and escapes their strings hold (its check reads the bytes, not the value)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from rollover import codec

TRICKY_STRINGS = ['[{"', "]]}}", '\\"[', "\\\\", '\\\\"{', "x", "xx[]x", "\u00e9{", ""]


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _value(rng: random.Random, depth: int) -> Any:
    if depth == 0 or rng.random() < 0.15:
        return rng.choice([1, -2.5, None, True, *TRICKY_STRINGS])
    if rng.random() < 0.5:
        return [_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(TRICKY_STRINGS) + str(i): _value(rng, depth - 1) for i in range(rng.randint(0, 3))}


def test_the_depth_check_agrees_with_a_walk_of_the_value():
    rng = random.Random(12)
    for _ in range(1500):
        value = _value(rng, rng.randint(1, 10))
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        for limit in (1, 2, 3, 5, 8):
            assert codec._deeper_than(raw, limit) == (_depth(value) > limit), (raw, limit)


@pytest.mark.parametrize("depth", [63, 64, 65, 300])
def test_loads_refuses_only_what_is_deeper_than_the_limit(depth):
    raw = "[" * depth + '"]]]"' + "]" * depth
    if depth > 64:
        with pytest.raises(codec.JSONCodecError, match="nested deeper than 64"):
            codec.loads(raw, max_depth=64)
    else:
        assert _depth(codec.loads(raw, max_depth=64)) == depth
