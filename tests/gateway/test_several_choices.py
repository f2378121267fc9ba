"""`n` > 1: every choice of a call is recorded, and each becomes its own training sample."""

import httpx
import pytest

from rollover.training.samples import build_samples
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout


@pytest.fixture
def registered(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 2}])
    return stub


def streamed(response: httpx.Response) -> list[str]:
    return [line for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_every_choice_is_recorded_and_becomes_a_sample(gateway, admin, registered, endpoint, stream):
    rid = running_rollout(admin)
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat/completions" else {"prompt": "hi"}
    response = httpx.post(
        proxy_url(gateway, rid, endpoint=endpoint), json=body | {"n": 3, "stream": stream}, headers=agent_headers(rid)
    )
    assert response.status_code == 200
    if stream:
        assert streamed(response)[-1] == "data: [DONE]"
    else:
        assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]
    assert registered.behaviour.requests[-1]["n"] == 3

    [event] = admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    data = event["data"]
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({tuple(c["response_token_ids"]) for c in choices}) == 3  # three different answers
    assert all(len(c["response_logprobs"]) == len(c["response_token_ids"]) == 4 for c in choices)
    assert choices[1]["response_logprobs"] == pytest.approx([-0.11, -0.21, -0.31, -0.41])
    # the first choice stays where a one-choice call has it
    assert (data["response_token_ids"], data["response_logprobs"]) == (
        choices[0]["response_token_ids"],
        choices[0]["response_logprobs"],
    )

    bundle = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()
    triplets = bundle["triplets"]
    assert [t["choice_index"] for t in triplets] == [0, 1, 2]
    assert [t["response_token_ids"] for t in triplets] == [c["response_token_ids"] for c in choices]
    assert all(t["prompt_token_ids"] == data["prompt_token_ids"] and t["policy_version"] == 2 for t in triplets)
    samples = build_samples(rid, "g", triplets, reward=1.0, max_length=None)
    assert [s.input_ids for s in samples] == [data["prompt_token_ids"] + c["response_token_ids"] for c in choices]
    assert all(s.num_loss_tokens == 4 for s in samples)

    [trimmed] = [
        e
        for e in admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
        if e["event_type"] == "model_request"
    ]
    assert trimmed["data"]["choices"] == choices  # Agent Lightning's view keeps them too
