"""The wire pieces the translated APIs share."""

from __future__ import annotations

import json

import pytest

from rollover.gateway.apis.common import SLOT, EventTemplate, sse


@pytest.mark.parametrize("text", [" word", 'a "quoted"\nline\\', "ünïcode ✓ 日本", ""])
def test_an_event_template_writes_what_the_whole_event_would(text: str) -> None:
    data = {"type": "delta", "sequence_number": SLOT, "item": "msg_1", "delta": {"text": SLOT}, "logprobs": []}
    filled = EventTemplate("delta", data).fill(7, text)
    expected = {"type": "delta", "sequence_number": 7, "item": "msg_1", "delta": {"text": text}, "logprobs": []}
    assert filled == sse("delta", expected)
    assert json.loads(filled.split(b"data: ", 1)[1]) == expected


def test_an_event_template_refuses_the_wrong_number_of_values() -> None:
    template = EventTemplate("delta", {"type": "delta", "text": SLOT})
    with pytest.raises(ValueError, match="1 slots, given 2"):
        template.fill("a", "b")
