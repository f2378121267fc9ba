"""Wire shapes Agent Lightning's schemas need, pinned without the peer (the peer's own classes
validate the same answers in tests/agent_lightning_compat/test_peer_schemas.py): a rollout with
no timeout has no `timeout_seconds` (its `int` refuses null), format=triplet model requests
always carry `response_log_probs`, and a rollout moved to running without an attempt id runs
attempt "0" (its default attempt id)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from rollover.gateway.client import GatewayClient
from rollover.gateway.keys import scoped_key
from rollover.store.models import Rollout
from tests.conftest import ADMIN_KEY, serve_http


def post_rollouts(admin: httpx.Client, items: list[dict]) -> list[dict]:
    response = admin.post("/api/rollouts", json=items)
    assert response.status_code == 201, response.text
    return response.json()


def every_answer(admin: httpx.Client, rid: str) -> list[dict]:
    """The rollout as each read of the API answers it."""
    listed = [r for r in admin.get("/api/rollouts").json() if r["rollout_id"] == rid]
    return [admin.get(f"/api/rollouts/{rid}").json(), *listed]


# -- config.timeout_seconds -----------------------------------------------------------------


def test_no_timeout_is_answered_as_no_key_and_read_back_as_the_runs_default(gateway, admin):
    [created] = post_rollouts(admin, [{"input": 1}])
    [with_local] = post_rollouts(admin, [{"input": 2, "config": {"local": {"agent_class": "m.A"}}}])
    for rollout in (created, with_local):
        rid = rollout["rollout_id"]
        claimed = admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).json()
        for answer in (rollout, claimed, *every_answer(admin, rid)):
            assert "timeout_seconds" not in answer["config"], answer["config"]
            # Rollover's own reading: no timeout, so the controller uses the run's
            assert Rollout.model_validate(answer).config.timeout_seconds is None
    assert with_local["config"]["local"]["agent_class"] == "m.A"


@pytest.mark.parametrize("given,answered", [(60, 60), (60.0, 60), (1800.0, 1800), (0.5, 0.5), (2**31 - 1, 2**31 - 1)])
def test_a_timeout_is_answered_as_given_a_whole_one_as_an_integer(admin, given, answered):
    [created] = post_rollouts(admin, [{"config": {"timeout_seconds": given}}])
    rid = created["rollout_id"]
    for answer in (created, *every_answer(admin, rid)):
        timeout = answer["config"]["timeout_seconds"]
        assert timeout == answered and type(timeout) is type(answered)
    assert f'"timeout_seconds":{json.dumps(answered)}' in admin.get(f"/api/rollouts/{rid}").text


async def test_the_gateway_client_reads_no_timeout_as_none(gateway):
    async with GatewayClient(gateway.url, ADMIN_KEY) as client:
        [rollout] = await client.enqueue([{"input": 1}])
        assert rollout.config.timeout_seconds is None
        assert (await client.get_rollout(rollout.rollout_id)).config.timeout_seconds is None


# -- format=triplet: response_log_probs -----------------------------------------------------


class _RefusingUpstream(BaseHTTPRequestHandler):
    """An engine that refuses the call (4xx: recorded, not retried), with no token ids."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": {"message": "prompt too long", "type": "BadRequestError"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def triplet_calls(admin: httpx.Client, rid: str) -> list[dict]:
    events = admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
    return [e["data"] for e in events if e["event_type"] == "model_request"]


def call(gateway, rid: str, mode: str, content: str) -> httpx.Response:
    url = f"{gateway.url}/proxy/rollout/{rid}/attempt/0/mode/{mode}/openai/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": content}]}
    return httpx.post(url, json=body, headers={"x-api-key": scoped_key(ADMIN_KEY, rid, "0")}, timeout=30)


def test_triplet_model_requests_always_carry_response_log_probs(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    [train, val] = (r["rollout_id"] for r in post_rollouts(admin, [{"is_train": True}, {"is_train": False}]))
    for rid in (train, val):
        admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).raise_for_status()
    assert call(gateway, train, "train", "2+2?").status_code == 200
    assert call(gateway, val, "val", "2+2?").status_code == 200  # val: the engine is not asked for logprobs

    [trained] = triplet_calls(admin, train)
    assert trained["response_log_probs"] == trained["response_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert len(trained["response_token_ids"]) == 4 and trained["prompt_token_ids"]
    [validated] = triplet_calls(admin, val)
    assert "response_log_probs" in validated and validated["response_log_probs"] is None
    assert validated["response_token_ids"] == trained["response_token_ids"]


def test_a_refused_call_has_empty_token_ids_and_null_log_probs(gateway, admin):
    with serve_http(_RefusingUpstream) as port:
        admin.post("/api/models", json=[{"model": "policy", "endpoint": f"http://127.0.0.1:{port}/v1"}])
        [rid] = (r["rollout_id"] for r in post_rollouts(admin, [{}]))
        admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).raise_for_status()
        assert call(gateway, rid, "train", "hi").status_code == 400
    [raw] = admin.get(f"/api/rollouts/{rid}/events").json()
    assert raw["data"]["status_code"] == 400 and "response_token_ids" not in raw["data"]
    [refused] = triplet_calls(admin, rid)
    assert refused["prompt_token_ids"] == refused["response_token_ids"] == []  # as Agent Lightning's trim
    assert "response_log_probs" in refused and refused["response_log_probs"] is None
    assert refused["status_code"] == 400


# -- the default attempt id -----------------------------------------------------------------


def test_running_without_an_attempt_id_is_attempt_0(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    [rid] = (r["rollout_id"] for r in post_rollouts(admin, [{}]))
    claimed = admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).json()
    assert claimed["status"]["last_attempt_id"] == "0" and [a["attempt_id"] for a in claimed["attempts"]] == ["0"]
    # an agent following Agent Lightning's convention (attempt 0, the scoped key of attempt 0)
    assert call(gateway, rid, "train", "hi").status_code == 200
    agent = {"x-api-key": scoped_key(ADMIN_KEY, rid, "0")}
    reward = {"event_type": "reward", "data": {"value": 1.0}}
    posted = httpx.post(f"{gateway.url}/api/rollouts/{rid}/attempt/0/events", json=reward, headers=agent)
    assert posted.status_code == 201, posted.text
    bundle = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()
    assert bundle["attempt_id"] == "0" and bundle["reward"] == 1.0 and len(bundle["triplets"]) == 1
    # a second PATCH to running changes nothing (no new attempt)
    again = admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).json()
    assert [a["attempt_id"] for a in again["attempts"]] == ["0"]


def test_a_rollout_run_again_without_an_attempt_id_takes_the_next_number(admin):
    [rid] = (r["rollout_id"] for r in post_rollouts(admin, [{}]))
    running = {"status": {"state": "running"}}
    assert admin.patch(f"/api/rollouts/{rid}", json=running).json()["status"]["last_attempt_id"] == "0"
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "queuing", "error_message": "retry"}})
    again = admin.patch(f"/api/rollouts/{rid}", json=running).json()
    assert [a["attempt_id"] for a in again["attempts"]] == ["0", "1"]
    assert [a["state"] for a in again["attempts"]] == ["failed", "running"]


def test_a_named_attempt_is_kept(admin):
    """Rollover's controller names its attempts a1, a2...: an explicit id is the attempt."""
    [rid] = (r["rollout_id"] for r in post_rollouts(admin, [{}]))
    claimed = admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
    assert claimed.json()["status"]["last_attempt_id"] == "a1"
