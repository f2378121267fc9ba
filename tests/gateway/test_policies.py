"""Several policies (LoRA adapters) served by one engine: an agent picks one by the `model` it
asks for, the engine is asked for the name it serves that policy under now, and the record says
which policy the call trains; an endpoint without policies behaves as before they existed."""

from __future__ import annotations

import socket

import httpx
import pytest

from rollover.gateway.registry import ModelRegistry
from rollover.gateway.server import GatewayThread
from rollover.store.models import ModelEndpoint
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY
from tests.gateway.test_partial_rollout import partial_gateway
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout

POLICIES = {"planner": "planner-v3", "solver": "solver-v3"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NOT_A_POLICY = "model 'gpt-4o' is not a policy of this run: ask for one of 'planner', 'solver'"


def _engine(url: str, policies: dict[str, str] | None = None, model: str = "planner-v3") -> dict:
    # As the engine registers it: its first adapter's name as `model`, every policy's name.
    return {
        "model": model,
        "endpoint": url,
        "policy_version": 3,
        "policies": POLICIES if policies is None else policies,
    }


@pytest.fixture
def policies(admin, stub):
    admin.post("/api/models", json=[_engine(stub.base_url)]).raise_for_status()
    return stub


def _body(endpoint: str, model: str | None, stream: bool) -> dict:
    body: dict = {"messages": [{"role": "user", "content": "plan"}]} if endpoint == "chat/completions" else {}
    if endpoint == "completions":
        body["prompt"] = "plan:"
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
    return body


def _calls(admin, rid: str) -> list[dict]:
    return [e["data"] for e in admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["train", "val"])
def test_the_agents_model_picks_the_policy_the_engine_serves(gateway, admin, policies, endpoint, stream, mode):
    rid = running_rollout(admin, is_train=mode == "train")
    url = proxy_url(gateway, rid, mode=mode, endpoint=endpoint)
    with httpx.Client(headers=agent_headers(rid), timeout=30) as agent:
        for asked in ("planner", "solver"):
            response = agent.post(url, json=_body(endpoint, asked, stream))
            assert response.status_code == 200, response.text
            assert policies.behaviour.requests[-1]["model"] == POLICIES[asked]  # the served name
        refused = agent.post(url, json=_body(endpoint, "gpt-4o", stream))
        assert refused.status_code == 404
        assert refused.json() == {"error": "not found", "reason": NOT_A_POLICY}
        unnamed = agent.post(url, json=_body(endpoint, None, stream))
        assert unnamed.status_code == 404
        assert unnamed.json()["reason"] == "the call names no model: ask for one of 'planner', 'solver'"
        odd = agent.post(url, json=_body(endpoint, None, stream) | {"model": ["planner"]})
        assert odd.status_code == 404 and "['planner'] is not a policy" in odd.json()["reason"]
    assert len(policies.behaviour.requests) == 2  # the refused calls never reached the engine
    assert admin.get("/proxy/state").json()["inflight"] == 0
    recorded = _calls(admin, rid)
    assert [(c["policy"], c["model"], c["policy_version"]) for c in recorded] == [
        ("planner", "planner-v3", 3),
        ("solver", "solver-v3", 3),
    ]
    assert [c["request"]["model"] for c in recorded] == ["planner", "solver"]  # as the agent asked
    triplets = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"]
    assert [t["policy"] for t in triplets] == ["planner", "solver"]
    trimmed = admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
    assert [e["data"]["policy"] for e in trimmed] == ["planner", "solver"]


def test_the_model_list_names_the_policies_an_agent_may_ask_for(gateway, admin, stub):
    rid = running_rollout(admin)
    url = proxy_url(gateway, rid, endpoint="models")
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
    listed = httpx.get(url, headers=agent_headers(rid)).json()
    assert [m["id"] for m in listed["data"]] == ["policy"]  # one policy: the registered model, as before
    admin.post("/api/models", json=[_engine(stub.base_url)]).raise_for_status()
    listed = httpx.get(url, headers=agent_headers(rid)).json()
    assert listed["object"] == "list"
    assert [(m["id"], m["object"]) for m in listed["data"]] == [("planner", "model"), ("solver", "model")]


def test_without_policies_every_call_goes_to_the_model_whatever_it_asks(gateway, admin, stub):
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "policy_version": 2}])
    rid = running_rollout(admin)
    for asked in ("planner", None):
        response = httpx.post(
            proxy_url(gateway, rid), json=_body("chat/completions", asked, False), headers=agent_headers(rid)
        )
        assert response.status_code == 200, response.text
        assert stub.behaviour.requests[-1]["model"] == "policy"
    recorded = _calls(admin, rid)
    assert [c["model"] for c in recorded] == ["policy", "policy"] and all("policy" not in c for c in recorded)
    triplets = admin.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()["triplets"]
    assert [t["policy"] for t in triplets] == [None, None]
    assert ["policies" in m for m in admin.get("/api/models").json()] == [False]  # the registry as before


def test_a_call_moved_off_a_dead_engine_asks_the_next_one_for_its_own_name(gateway, admin, stub):
    """Engines mid-update serve a policy under different names: a call moved from one that
    cannot be reached is sent to the next with that one's name, not the first one's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    engines = [
        _engine(dead, {"planner": "planner-v3"}, model="policy"),
        _engine(stub.base_url, {"planner": "planner-v4"}, model="policy"),
    ]
    admin.post("/api/models", json=engines).raise_for_status()
    registry = ModelRegistry([ModelEndpoint.model_validate(e) for e in engines])
    rid = running_rollout(admin)
    while getattr(registry.pick(rid), "endpoint", None) != dead:
        rid = running_rollout(admin)
    response = httpx.post(
        proxy_url(gateway, rid), json=_body("chat/completions", "planner", False), headers=agent_headers(rid)
    )
    assert response.status_code == 200, response.text
    assert [r["model"] for r in stub.behaviour.requests] == ["planner-v4"]
    [call] = _calls(admin, rid)
    assert (call["upstream"], call["model"], call["policy"]) == (stub.base_url, "planner-v4", "planner")


def test_the_policies_outlive_a_gateway_restart(tmp_path):
    store = str(tmp_path / "store.db")
    headers = ADMIN
    with StubUpstream() as stub:
        with GatewayThread(store=store, admin_key=ADMIN_KEY) as first:
            httpx.post(f"{first.url}/api/models", json=[_engine(stub.base_url)], headers=headers).raise_for_status()
        with GatewayThread(store=store, admin_key=ADMIN_KEY) as second:
            [model] = httpx.get(f"{second.url}/api/models", headers=headers).json()
            assert model["policies"] == POLICIES
            with httpx.Client(base_url=second.url, headers=headers, timeout=30) as admin:
                rid = running_rollout(admin)
            response = httpx.post(
                proxy_url(second, rid), json=_body("chat/completions", "solver", False), headers=agent_headers(rid)
            )
            assert response.status_code == 200, response.text
            assert stub.behaviour.requests[-1]["model"] == "solver-v3"


def test_with_partial_rollout_the_policys_call_is_streamed_from_its_name_and_recorded(stub):
    with partial_gateway() as gateway, httpx.Client(base_url=gateway.url, headers=ADMIN, timeout=30) as admin:
        admin.post("/api/models", json=[_engine(stub.base_url)]).raise_for_status()
        rid = running_rollout(admin)
        url = proxy_url(gateway, rid)
        response = httpx.post(url, json=_body("chat/completions", "solver", False), headers=agent_headers(rid))
        assert response.status_code == 200, response.text
        sent = stub.behaviour.requests[-1]
        assert (sent["model"], sent["stream"]) == ("solver-v3", True)
        refused = httpx.post(url, json=_body("chat/completions", "gpt-4o", False), headers=agent_headers(rid))
        assert (refused.status_code, refused.json()["reason"]) == (404, NOT_A_POLICY)
        [call] = _calls(admin, rid)
        assert (call["policy"], call["model"], call["response_version_spans"]) == ("solver", "solver-v3", [[0, 3]])
