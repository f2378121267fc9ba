"""Several engines behind one gateway: sticky per rollout by rendezvous hashing over the live
endpoints; an engine that cannot be reached is taken out of rotation and its rollouts move to
the live ones; the admin takes endpoints out, puts them back or removes them."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from rollover.gateway.client import GatewayClient, NotFoundError
from rollover.gateway.registry import ModelRegistry
from rollover.gateway.server import GatewayThread
from rollover.store.models import ModelEndpoint
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY
from tests.gateway.test_proxy import agent_headers, proxy_url, running_rollout

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _endpoint(url: str, live: bool = True) -> ModelEndpoint:
    return ModelEndpoint(model="policy", endpoint=url, live=live)


def _placement(registry: ModelRegistry, rollout_ids: list[str]) -> dict[str, str]:
    placed = {}
    for rid in rollout_ids:
        target = registry.pick(rid)
        assert target is not None
        placed[rid] = target.endpoint
    return placed


def test_rendezvous_hashing_moves_only_what_it_must():
    urls = [f"http://10.0.0.{i}:8000/v1" for i in range(1, 5)]
    rollout_ids = [f"ro-{i:05d}" for i in range(4000)]
    registry = ModelRegistry([_endpoint(u) for u in urls])
    before = _placement(registry, rollout_ids)
    # Balanced: each of 4 endpoints gets about a quarter.
    assert all(900 < n < 1100 for n in Counter(before.values()).values()), Counter(before.values())

    # One taken out of rotation: only its rollouts move, and all to live endpoints.
    registry.set_live(urls[1], False)
    after = _placement(registry, rollout_ids)
    moved = {rid for rid in rollout_ids if after[rid] != before[rid]}
    assert moved == {rid for rid in rollout_ids if before[rid] == urls[1]}
    assert set(after.values()) == {urls[0], urls[2], urls[3]}
    # Spread over the three left, not piled onto one.
    assert all(250 < n < 450 for n in Counter(after[rid] for rid in moved).values())

    # Back in rotation: every rollout is where it was; removed outright: as when out of rotation.
    registry.set_live(urls[1], True)
    assert _placement(registry, rollout_ids) == before
    registry.remove(urls[1])
    assert _placement(registry, rollout_ids) == after

    # One joining takes ~1/N, only for itself, wherever it sits in the list.
    registry = ModelRegistry([_endpoint(u) for u in urls])
    registry.upsert([_endpoint("http://10.0.0.5:8000/v1")])
    grown = _placement(registry, rollout_ids)
    moved = {rid for rid in rollout_ids if grown[rid] != before[rid]}
    assert {grown[rid] for rid in moved} == {"http://10.0.0.5:8000/v1"}
    assert 600 < len(moved) < 1000
    assert _placement(ModelRegistry(list(reversed(registry.endpoints))), rollout_ids) == grown

    # None live: nothing to pick.
    assert ModelRegistry([_endpoint(urls[0], live=False)]).pick("ro-1") is None


def _rollouts_on_each(admin, urls: list[str], at_least: int = 2) -> dict[str, list[str]]:
    """Running rollouts until each endpoint has `at_least` (where the gateway will send them)."""
    registry = ModelRegistry([_endpoint(u) for u in urls])
    on: dict[str, list[str]] = {u: [] for u in urls}
    while min(len(v) for v in on.values()) < at_least:
        rid = running_rollout(admin)
        on[_placement(registry, [rid])[rid]].append(rid)
    return on


def _upstreams(admin, rid: str) -> list[str]:
    events = admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    return [e["data"]["upstream"] for e in events]


def _call(agents: httpx.Client, gateway, rid: str) -> httpx.Response:
    return agents.post(
        proxy_url(gateway, rid), json={"messages": [{"role": "user", "content": rid}]}, headers=agent_headers(rid)
    )


def test_a_stopped_engine_is_taken_out_its_rollouts_move_and_that_outlives_a_gateway_restart(tmp_path):
    store = str(tmp_path / "store.db")
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as gateway, StubUpstream() as a, StubUpstream() as b:
        admin = httpx.Client(base_url=gateway.url, headers=ADMIN, timeout=30)
        # As an older client registers: no `live`.
        models = [{"model": "policy", "endpoint": a.base_url}, {"model": "policy", "endpoint": b.base_url}]
        assert [m["live"] for m in admin.post("/api/models", json=models).json()] == [True, True]
        on = _rollouts_on_each(admin, [a.base_url, b.base_url])
        with httpx.Client(timeout=60) as agents:
            for rid in on[a.base_url] + on[b.base_url]:
                assert _call(agents, gateway, rid).status_code == 200
            served_by_a = a.behaviour.completed

            a.stop()  # the engine dies mid-run
            for _ in range(2):
                for rid in on[a.base_url] + on[b.base_url]:
                    response = _call(agents, gateway, rid)
                    assert response.status_code == 200, response.text
        assert a.behaviour.completed == served_by_a
        for rid in on[a.base_url]:
            assert _upstreams(admin, rid) == [a.base_url, b.base_url, b.base_url]
        for rid in on[b.base_url]:
            assert _upstreams(admin, rid) == [b.base_url] * 3  # never moved
        live = {m["endpoint"]: m["live"] for m in admin.get("/api/models").json()}
        assert live == {a.base_url: False, b.base_url: True}
        admin.close()
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as again:
        models = httpx.get(f"{again.url}/api/models", headers=ADMIN).json()
        assert {m["endpoint"]: m["live"] for m in models} == {a.base_url: False, b.base_url: True}


async def test_the_admin_takes_endpoints_out_puts_them_back_and_removes_them(gateway, admin):
    with StubUpstream() as a, StubUpstream() as b, httpx.Client(timeout=30) as agents:
        client = GatewayClient(gateway.url, ADMIN_KEY)
        try:
            await client.register_models([_endpoint(a.base_url), _endpoint(b.base_url)])
            on = _rollouts_on_each(admin, [a.base_url, b.base_url], at_least=1)
            rid_a, rid_b = on[a.base_url][0], on[b.base_url][0]

            taken_out = await client.set_model_live(a.base_url, False)
            assert (taken_out.endpoint, taken_out.live) == (a.base_url, False)
            assert _call(agents, gateway, rid_a).status_code == 200
            assert (await client.set_model_live(a.base_url, True)).live
            assert _call(agents, gateway, rid_a).status_code == 200  # sticky again: back on a
            assert _upstreams(admin, rid_a) == [b.base_url, a.base_url]

            # A registration says whether it is live too (and re-registering puts it back).
            await client.register_models([_endpoint(b.base_url, live=False)])
            assert _call(agents, gateway, rid_b).status_code == 200
            assert _upstreams(admin, rid_b) == [a.base_url]

            left = await client.remove_model(a.base_url)
            assert [(m.endpoint, m.live) for m in left] == [(b.base_url, False)]
            assert await client.remove_model(a.base_url) == left  # nothing to do: no error
            with pytest.raises(NotFoundError, match="no inference endpoint"):
                await client.set_model_live(a.base_url, True)

            # None live: 503 in the gateway's error shape, nothing sent anywhere.
            sent = len(b.behaviour.requests)
            refused = _call(agents, gateway, rid_b)
            assert refused.status_code == 503
            assert refused.json()["error"] == "upstream error" and "out of rotation" in refused.json()["reason"]
            assert len(b.behaviour.requests) == sent
            assert [(m.endpoint, m.live) for m in await client.list_models()] == [(b.base_url, False)]
        finally:
            await client.aclose()

    # Bad requests and keys: JSON errors, nothing changed.
    assert admin.patch("/api/models", params={"endpoint": b.base_url}, json={}).status_code == 422
    assert admin.patch("/api/models", json={"live": True}).status_code == 422
    agent = agent_headers(rid_b)
    for method, kwargs in (("PATCH", {"json": {"live": True}}), ("DELETE", {}), ("GET", {})):
        refused = httpx.request(
            method, f"{gateway.url}/api/models", params={"endpoint": b.base_url}, headers=agent, **kwargs
        )
        assert refused.status_code == 403 and set(refused.json()) == {"error", "reason"}
    assert [(m["endpoint"], m["live"]) for m in admin.get("/api/models").json()] == [(b.base_url, False)]
