"""The store REST API over real HTTP: status codes, auth, and bad input that changes nothing."""

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from rollover.store.models import Event, Rollout
from tests.conftest import ADMIN_KEY


def make_rollout(admin, **extra):
    response = admin.post("/api/rollouts", json=[{"input": {"q": "1+1"}, "metadata": {"data_id": "d0"}, **extra}])
    assert response.status_code == 201, response.text
    return response.json()[0]


def claim(admin, rollout_id, attempt_id="a1"):
    response = admin.patch(
        f"/api/rollouts/{rollout_id}", json={"status": {"state": "running", "last_attempt_id": attempt_id}}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_healthz_needs_no_key(gateway):
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok", "instance": gateway.settings.instance}


def test_create_get_list_patch_delete(admin):
    r = make_rollout(admin, config={"timeout_seconds": 60, "local": {"agent_class": "m:A", "env_map": {"Q": "q"}}})
    assert r["status"]["state"] == "queuing" and r["config"]["timeout_seconds"] == 60
    assert admin.get(f"/api/rollouts/{r['rollout_id']}").json()["input"] == {"q": "1+1"}
    listed = admin.get("/api/rollouts", params=[("state_in", "queuing"), ("state_in", "running"), ("limit", 10)]).json()
    assert [x["rollout_id"] for x in listed] == [r["rollout_id"]]
    claimed = claim(admin, r["rollout_id"])
    assert claimed["status"]["last_attempt_id"] == "a1"
    assert admin.get("/api/rollouts", params={"state_in": "queuing"}).json() == []
    assert admin.delete(f"/api/rollouts/{r['rollout_id']}").status_code == 200
    assert admin.get(f"/api/rollouts/{r['rollout_id']}").status_code == 404


def test_idempotent_post_with_caller_id(admin):
    first = make_rollout(admin, rollout_id="job-1")
    claim(admin, "job-1")
    again = admin.post("/api/rollouts", json=[{"rollout_id": "job-1", "input": "other"}]).json()[0]
    assert again["status"]["state"] == "running" and again["input"] == first["input"]


def test_illegal_transition_is_409_and_changes_nothing(admin):
    r = make_rollout(admin)
    response = admin.patch(f"/api/rollouts/{r['rollout_id']}", json={"status": {"state": "succeeded"}})
    assert response.status_code == 409
    assert response.json()["error"] == "conflict" and "queuing" in response.json()["reason"]
    assert admin.get(f"/api/rollouts/{r['rollout_id']}").json() == r


def test_patch_touches_only_status(admin):
    r = make_rollout(admin)
    response = admin.patch(f"/api/rollouts/{r['rollout_id']}", json={"status": {"state": "running"}, "input": "hacked"})
    assert response.status_code == 422
    assert admin.get(f"/api/rollouts/{r['rollout_id']}").json() == r


@pytest.mark.parametrize(
    "method,path,body,status",
    [
        ("post", "/api/rollouts", b"{not json", 400),
        ("post", "/api/rollouts", b'[{"is_train": "maybe"}]', 422),
        ("post", "/api/rollouts", b'[{"config": {"timeout_seconds": -1}}]', 422),
        ("post", "/api/rollouts", b'[{"unknown_field": 1}]', 422),
        ("post", "/api/models", b'[{"model": "m", "endpoint": "not-a-url"}]', 422),
        ("post", "/proxy/pause", b'{"retry_after_seconds": "soon"}', 422),
        ("patch", "/api/rollouts/nope", b'{"status": {"state": "running"}}', 404),
        ("get", "/api/rollouts/nope/events", None, 404),
        ("post", "/api/rollouts/nope/attempt/a1/events", b'{"event_type": "reward", "data": {"value": 1}}', 404),
    ],
)
def test_bad_input_is_4xx_json_and_store_unchanged(admin, method, path, body, status):
    before = admin.get("/api/rollouts").json()
    response = admin.request(method.upper(), path, content=body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["reason"] and payload["error"]
    assert admin.get("/api/rollouts").json() == before


def test_oversized_body_is_413(gateway):
    from rollover.gateway.server import GatewayThread

    with GatewayThread(admin_key=ADMIN_KEY, max_body_bytes=1000) as small:
        headers = {"x-api-key": ADMIN_KEY}
        response = httpx.post(f"{small.url}/api/rollouts", content=b"[" + b" " * 5000 + b"]", headers=headers)
        assert response.status_code == 413 and "1000" in response.json()["reason"]

        def chunks():
            yield b'[{"input": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}]'

        response = httpx.post(f"{small.url}/api/rollouts", content=chunks(), headers=headers)
        assert response.status_code == 413
        assert httpx.get(f"{small.url}/api/rollouts", headers=headers).json() == []


def test_events_raw_and_triplet(admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 2}])
    r = make_rollout(admin)
    claim(admin, r["rollout_id"])
    url = f"/api/rollouts/{r['rollout_id']}/attempt/a1/events"
    call = admin.post(
        f"/proxy/rollout/{r['rollout_id']}/attempt/a1/mode/train/openai/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
    ).json()
    assert admin.post(url, json={"event_type": "reward", "data": {"value": 1.0}}).status_code == 201
    raw = admin.get(f"/api/rollouts/{r['rollout_id']}/events", params={"event_type": "reward"}).json()
    assert [e["data"] for e in raw] == [{"value": 1.0}]
    triplet = admin.get(f"/api/rollouts/{r['rollout_id']}/events", params={"format": "samples"}).json()
    assert triplet["reward"] == 1.0
    [recorded] = triplet["triplets"]
    assert recorded["response_token_ids"] == call["choices"][0]["token_ids"] and recorded["policy_version"] == 2


def test_auth_admin_and_scoped_keys(gateway, admin):
    mine, other = make_rollout(admin), make_rollout(admin)
    for r in (mine, other):
        claim(admin, r["rollout_id"])
    key = scoped_key(ADMIN_KEY, mine["rollout_id"], "a1")
    agent = httpx.Client(base_url=gateway.url, headers={"x-api-key": key})
    anon = httpx.Client(base_url=gateway.url)
    reward = {"event_type": "reward", "data": {"value": 1}}
    assert agent.post(f"/api/rollouts/{mine['rollout_id']}/attempt/a1/events", json=reward).status_code == 201
    assert agent.get(f"/api/rollouts/{mine['rollout_id']}").status_code == 200
    # elsewhere the scoped key is refused with 403
    assert agent.post(f"/api/rollouts/{other['rollout_id']}/attempt/a1/events", json=reward).status_code == 403
    assert agent.get("/api/rollouts").status_code == 403
    assert agent.post("/proxy/pause", json={}).status_code == 403
    assert (
        agent.patch(f"/api/rollouts/{mine['rollout_id']}", json={"status": {"state": "succeeded"}}).status_code == 403
    )
    assert (
        agent.post(
            f"/proxy/rollout/{other['rollout_id']}/attempt/a1/mode/train/openai/v1/chat/completions", json={}
        ).status_code
        == 403
    )
    # no key: 401; wrong key: 401
    assert anon.get("/api/rollouts").status_code == 401
    assert anon.get("/api/rollouts", headers={"Authorization": "Bearer wrong"}).json()["error"] == "unauthorized"
    assert admin.get(f"/api/rollouts/{other['rollout_id']}/events").json() == []


def test_models_registry(admin):
    assert admin.post("/api/models", json=[{"model": "policy", "endpoint": "http://127.0.0.1:1/v1"}]).status_code == 201
    admin.post("/api/models", json=[{"model": "policy", "endpoint": "http://127.0.0.1:1/v1", "policy_version": 3}])
    assert admin.get("/api/models").json() == [
        {
            "model": "policy",
            "endpoint": "http://127.0.0.1:1/v1",
            "policy_version": 3,
            "live": True,
            "frozen": False,
            "version": 3,
        }
    ]
    # Agent Lightning's name for it is read too
    admin.post("/api/models", json=[{"model": "policy", "endpoint": "http://127.0.0.1:1/v1", "version": 4}])
    assert admin.get("/api/models").json()[0]["policy_version"] == 4
    admin.delete("/api/models")
    assert admin.get("/api/models").json() == []


def test_terminal_rollouts_page_in_the_order_they_finished(admin, gateway):
    """Agent Lightning's `GET /api/rollouts/terminal`: a cursor over finished rollouts."""
    ids = [
        admin.post("/api/rollouts", json=[{"input": {"data_id": f"d{i}"}, "is_train": i != 1}]).json()[0]["rollout_id"]
        for i in range(3)
    ]
    for rollout_id, state in ((ids[2], "succeeded"), (ids[0], "failed")):
        claim(admin, rollout_id)
        assert admin.patch(f"/api/rollouts/{rollout_id}", json={"status": {"state": state}}).status_code == 200
    first = admin.get("/api/rollouts/terminal", params={"after": 0, "limit": 1}).json()
    assert first == {
        "items": [{"rollout_id": ids[2], "state": "succeeded", "data_id": "d2", "is_train": True}],
        "next_after": 1,
        "total_terminal": 2,
    }
    rest = admin.get("/api/rollouts/terminal", params={"after": first["next_after"]}).json()
    assert [(i["rollout_id"], i["state"]) for i in rest["items"]] == [(ids[0], "failed")] and rest["next_after"] == 2
    assert admin.get("/api/rollouts/terminal", params={"after": 2}).json()["items"] == []
    assert admin.get("/api/rollouts/terminal", params={"after": -1}).status_code == 422
    agent = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, ids[1], 'a1')}"}
    assert httpx.get(f"{gateway.url}/api/rollouts/terminal", headers=agent).status_code == 403


def test_posted_events_and_batches_are_answered_as_the_models_write_them(admin):
    """The POSTs written without their models (events, rollout batches) answer what the
    models would, field for field, in the same order."""
    [first, second] = admin.post(
        "/api/rollouts", json=[{"input": {"q": "é"}}, {"input": [1], "is_train": False, "config": {"k8s": {}}}]
    ).json()
    for rollout in (first, second):
        assert list(rollout.items()) == list(Rollout.model_validate(rollout).model_dump(mode="json").items())
    claim(admin, first["rollout_id"])
    url = f"/api/rollouts/{first['rollout_id']}/attempt/a1/events"
    posted = admin.post(url, json={"event_type": "reward", "data": {"value": 0.5}})
    assert posted.status_code == 201
    event = posted.json()
    assert list(event.items()) == list(Event.model_validate(event).model_dump(mode="json").items())
    assert admin.get(f"/api/rollouts/{first['rollout_id']}/events").json() == [event]


def test_a_guessed_key_on_an_overlong_id_is_refused_and_not_remembered(gateway, admin):
    """An id longer than any the store accepts names no attempt: 403, and the key cache (one
    HMAC per attempt) does not keep what a caller without a key sent."""
    before = scoped_key.cache_info().currsize
    agent = httpx.Client(base_url=gateway.url, headers={"x-api-key": "rk-guess"})
    for n in range(5):
        answer = agent.post(f"/api/rollouts/{'r' * 5000}{n}/attempt/a1/events", json={"event_type": "x", "data": {}})
        assert answer.status_code == 403 and answer.json()["error"]
    assert scoped_key.cache_info().currsize == before
