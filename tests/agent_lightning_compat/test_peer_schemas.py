"""Rollover's answers read by the peer's own code: Agent Lightning 1.0.2's schema classes
(`agentlightning.schemas`), its format=triplet trim (`agentlightning.server.routes.events`) and
its client, against Rollover's gateway on loopback. The same shapes are pinned without the
peer in tests/gateway/test_agl_wire.py."""

from __future__ import annotations

import json

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from tests.agent_lightning_compat.conftest import agl_run
from tests.conftest import ADMIN_KEY, serve_http
from tests.gateway.test_agl_wire import _RefusingUpstream

pytestmark = pytest.mark.slow  # the Agent Lightning peer: a process of its own per test

# Each answer as the peer reads it: `Rollout` (its `RolloutConfig.timeout_seconds` is an `int`,
# 3600 when absent, and refuses null), strictly from the JSON text too (a whole number of
# seconds as an integer, not 60.0).
READ_ROLLOUTS = """
import json, sys
from pydantic import TypeAdapter
from agentlightning.schemas import Rollout
answers = json.load(sys.stdin)
rollouts = TypeAdapter(list[Rollout])
timeouts = {}
for name, raw in answers.items():
    read = rollouts.validate_json(raw)
    strict = [r["config"].get("timeout_seconds") for r in json.loads(raw)]
    TypeAdapter(list[int | None]).validate_python(strict, strict=True)
    timeouts[name] = [r.config.timeout_seconds for r in read]
print(json.dumps(timeouts))
"""


def test_rollouts_with_and_without_a_timeout_are_agent_lightning_rollouts(agl_python, admin):
    created = admin.post(
        "/api/rollouts",
        json=[
            {"input": 1},  # no config: Rollover's meaning, the run's timeout
            {"input": 2, "config": {"local": {"agent_class": "m.A"}}},  # a config without a timeout
            {"input": 3, "config": {"timeout_seconds": 60}},  # as Agent Lightning's trainer sends it
            {"input": 4, "config": {"timeout_seconds": 1800.0}},  # as Rollover's trainer sends it
        ],
    )
    assert created.status_code == 201, created.text
    ids = [r["rollout_id"] for r in created.json()]
    claimed = admin.patch(f"/api/rollouts/{ids[0]}", json={"status": {"state": "running"}})
    finished = admin.patch(f"/api/rollouts/{ids[0]}", json={"status": {"state": "succeeded"}})
    answers = {
        "created": created.text,
        "claimed": f"[{claimed.text}]",
        "finished": f"[{finished.text}]",
        "each": "[" + ",".join(admin.get(f"/api/rollouts/{rid}").text for rid in ids) + "]",
        "listed": admin.get("/api/rollouts", params={"state_in": ["queuing", "succeeded"]}).text,
    }
    timeouts = agl_run(agl_python, READ_ROLLOUTS, answers)
    # no timeout reads as the peer's own default (3600); given ones as given
    assert timeouts["created"] == timeouts["each"] == [3600, 3600, 60, 1800]
    assert timeouts["claimed"] == timeouts["finished"] == [3600]
    assert sorted(timeouts["listed"]) == [60, 1800, 3600, 3600]


# The raw events and format=triplet as the peer reads them, and the peer's own format=triplet
# made from Rollover's raw events (what Agent Lightning's gateway would answer for the same
# calls): its model requests' token ids and `response_log_probs`.
PEER_TRIPLET = """
import json, sys
from pydantic import TypeAdapter
from agentlightning.schemas import Event, ModelRequestData
from agentlightning.server.routes.events import _dedupe_model_requests_by_prompt_token_ids, _to_triplet_format
events = TypeAdapter(list[Event])
out = {}
for rid, answer in json.load(sys.stdin).items():
    raw = events.validate_json(answer["raw"])
    triplet = events.validate_json(answer["triplet"])
    for event in triplet:
        if event.event_type == "model_request":
            ModelRequestData.model_validate(event.data)
    theirs = _dedupe_model_requests_by_prompt_token_ids([_to_triplet_format(e) for e in raw])
    keys = ("prompt_token_ids", "response_token_ids", "response_log_probs")
    out[rid] = [{k: e.data[k] for k in keys} for e in theirs if e.event_type == "model_request"]
print(json.dumps(out))
"""


def agent_call(gateway, rid: str, mode: str, content: str) -> int:
    url = f"{gateway.url}/proxy/rollout/{rid}/attempt/0/mode/{mode}/openai/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": content}]}
    headers = {"x-api-key": scoped_key(ADMIN_KEY, rid, "0")}
    return httpx.post(url, json=body, headers=headers, timeout=30).status_code


def test_triplet_model_requests_are_agent_lightnings_own_trim(agl_python, gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    created = admin.post("/api/rollouts", json=[{"is_train": True}, {"is_train": False}, {}]).json()
    train, val, refused = (r["rollout_id"] for r in created)
    for rid in (train, val, refused):
        admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).raise_for_status()
    for content in ("2+2?", "3+3?", "2+2?"):  # a prompt retried: the peer keeps its last call
        assert agent_call(gateway, train, "train", content) == 200
    assert agent_call(gateway, val, "val", "2+2?") == 200  # no logprobs asked of the engine
    with serve_http(_RefusingUpstream) as port:
        admin.delete("/api/models").raise_for_status()
        admin.post("/api/models", json=[{"model": "policy", "endpoint": f"http://127.0.0.1:{port}/v1"}])
        assert agent_call(gateway, refused, "train", "hi") == 400  # recorded without token ids
    answers = {
        rid: {
            "raw": admin.get(f"/api/rollouts/{rid}/events").text,
            "triplet": admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).text,
        }
        for rid in (train, val, refused)
    }
    theirs = agl_run(agl_python, PEER_TRIPLET, answers)
    for rid in (train, val, refused):
        ours = [
            {k: e["data"][k] for k in ("prompt_token_ids", "response_token_ids", "response_log_probs")}
            for e in json.loads(answers[rid]["triplet"])
            if e["event_type"] == "model_request"
        ]
        assert ours == theirs[rid], rid
    assert len(theirs[train]) == 2 and all(len(c["response_log_probs"]) == 4 for c in theirs[train])
    assert [c["response_log_probs"] for c in theirs[val]] == [None]
    assert theirs[refused] == [{"prompt_token_ids": [], "response_token_ids": [], "response_log_probs": None}]


# An agent and a controller following Agent Lightning's convention, with its own client and
# schema classes: the move to running names no attempt (`RolloutStatusPatch` left unset, as its
# reconciler sends it), then attempt DEFAULT_ATTEMPT_ID ("0") is used for the model call and
# the reward, and the answers are read as its `Rollout` and `Event`.
AGL_CONVENTION = """
import json, sys
from agentlightning.client import AgentLightningSyncClient
from agentlightning.schemas import (
    DEFAULT_ATTEMPT_ID, Event, EventCreate, Rollout, RolloutPatch, RolloutState, RolloutStatusPatch,
)
url, key, rid = sys.argv[1:4]
client = AgentLightningSyncClient(key=key, base_url=url, timeout=30)
patch = RolloutPatch(status=RolloutStatusPatch(state=RolloutState.RUNNING))
claimed = client.patch(f"/api/rollouts/{rid}", json=patch.model_dump(mode="json", exclude_unset=True))
claimed.raise_for_status()
base = f"/proxy/rollout/{rid}/attempt/{DEFAULT_ATTEMPT_ID}/mode/train/openai/v1"
called = client.post(f"{base}/chat/completions", json={"model": "any", "messages": [{"role": "user", "content": "hi"}]})
reward = EventCreate(event_type="reward", data={"value": 1.0})
posted = client.post(f"/api/rollouts/{rid}/attempt/{DEFAULT_ATTEMPT_ID}/events", json=reward.model_dump(mode="json"))
posted.raise_for_status()
events = [Event.model_validate(e) for e in client.get(f"/api/rollouts/{rid}/events").json()]
print(json.dumps({
    "last_attempt_id": Rollout.model_validate(claimed.json()).status.last_attempt_id,
    "call": called.status_code,
    "reward_attempt": Event.model_validate(posted.json()).attempt_id,
    "events": [[e.event_type, e.attempt_id] for e in events],
}))
"""


def test_agent_lightnings_attempt_0_works_without_rollovers_controller(agl_python, gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    [rid] = (r["rollout_id"] for r in admin.post("/api/rollouts", json=[{"input": {"q": 1}}]).json())
    seen = agl_run(agl_python, AGL_CONVENTION, None, gateway.url, ADMIN_KEY, rid)
    assert seen == {
        "last_attempt_id": "0",
        "call": 200,
        "reward_attempt": "0",
        "events": [["model_request", "0"], ["reward", "0"]],
    }
    samples = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()
    assert samples["attempt_id"] == "0" and samples["reward"] == 1.0 and len(samples["triplets"]) == 1
