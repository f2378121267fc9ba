"""Train-mode calls may carry only fields that keep the recorded logprobs the behaviour
policy's; `n` is capped in both modes (`gateway.max_n`, default `actor_rollout_ref.rollout.n`)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from rollover.config import GatewaySettings, load_config
from rollover.gateway.sampling import ForbiddenField, check_request
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"11": 100}),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1.0),
        ("repetition_penalty", 1.3),
        ("allowed_token_ids", [1, 2, 3]),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("guided_choice", ["yes", "no"]),
        ("structured_outputs", {"choice": ["a"]}),
        ("min_tokens", 5),
        ("use_beam_search", True),
        ("best_of", 4),
        ("echo", True),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "calc"}}),
        ("response_format", {"type": "json_object"}),
        ("bad_words", ["x"]),
        ("some_new_engine_knob", 1),
    ],
)
def test_fields_that_change_what_is_sampled_are_refused_in_train_mode(field: str, value: Any) -> None:
    with pytest.raises(ForbiddenField) as refused:
        check_request({**CHAT, field: value}, "chat/completions", "train", max_n=4)
    assert refused.value.field == field and field in refused.value.reason
    check_request({**CHAT, field: value}, "chat/completions", "val", max_n=4)  # val trains nothing


def test_what_agents_and_harnesses_send_passes() -> None:
    body = {
        **CHAT,
        "temperature": 0.7,  # the proxy forces the mode's own
        "top_p": 0.9,
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "stop": ["\n\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "seed": 3,
        "n": 4,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "text"},
        # neutral values of the guarded fields
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "best_of": 1,
        "ignore_eos": True,
        "user": "u",
        "metadata": {"a": "b"},
    }
    check_request(body, "chat/completions", "train", max_n=4)
    check_request({"model": "p", "prompt": "2+2=", "max_tokens": 4, "logprobs": 1}, "completions", "train", max_n=1)


@pytest.mark.parametrize("n", [0, 5, 50, True, "2", 2.0])
def test_n_is_capped_in_both_modes(n: Any) -> None:
    for mode in ("train", "val"):
        with pytest.raises(ForbiddenField, match="gateway.max_n"):
            check_request({**CHAT, "n": n}, "chat/completions", mode, max_n=4)


def test_max_n_defaults_to_the_rollout_n() -> None:
    config = load_config(None, ["actor_rollout_ref.rollout.n=8"])
    assert GatewaySettings.from_config(config).max_n == 8
    assert GatewaySettings.from_config(config, max_n=2).max_n == 2


def test_the_proxy_answers_400_naming_the_field_and_sends_nothing(gateway, admin, stub) -> None:
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    registered = stub
    rid = running_rollout(admin)
    sent_before = len(registered.behaviour.requests)
    for field, value in (("logit_bias", {"5": 50}), ("n", 50)):
        response = httpx.post(proxy_url(gateway, rid), json={**CHAT, field: value}, headers=agent_headers(rid))
        assert response.status_code == 400, response.text
        assert set(response.json()) == {"error", "reason"} and field in response.json()["reason"]
    assert len(registered.behaviour.requests) == sent_before  # the engine never saw them
    assert admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json() == []
    ok = httpx.post(proxy_url(gateway, rid), json={**CHAT, "temperature": 0.2}, headers=agent_headers(rid))
    assert ok.status_code == 200, ok.text
