"""64 agents against a paused/resumed gateway, and a SIGKILL of the gateway mid-traffic."""

import asyncio
import json
import sqlite3
import threading
import time

import httpx
import pytest

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayProcess
from rollover.testing.stub_upstream import StubBehaviour, StubUpstream
from tests.conftest import ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
RUN_A1 = {"status": {"state": "running", "last_attempt_id": "a1"}}  # the attempt the tests post to


async def make_running_rollouts(client: httpx.AsyncClient, count: int) -> list[str]:
    created = (
        await client.post("/api/rollouts", json=[{"input": {"i": i}} for i in range(count)], headers=ADMIN)
    ).json()
    for r in created:
        assert (await client.patch(f"/api/rollouts/{r['rollout_id']}", json=RUN_A1, headers=ADMIN)).status_code == 200
    return [r["rollout_id"] for r in created]


@pytest.mark.slow
def test_64_agents_through_pause_and_resume(tmp_path):
    calls_per_agent = 8
    with (
        StubUpstream(StubBehaviour(delay_seconds=0.05)) as stub,
        GatewayProcess(store=str(tmp_path / "g.db"), admin_key=ADMIN_KEY) as gateway,
    ):

        async def scenario():
            async with httpx.AsyncClient(
                base_url=gateway.url, timeout=60, limits=httpx.Limits(max_connections=200)
            ) as client:
                await client.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}], headers=ADMIN)
                rollout_ids = await make_running_rollouts(client, 64)
                refusals: list[httpx.Response] = []
                ok_counts = dict.fromkeys(rollout_ids, 0)

                async def agent(rid: str) -> None:
                    headers = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}
                    url = f"/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions"
                    while ok_counts[rid] < calls_per_agent:
                        response = await client.post(
                            url, json={"messages": [{"role": "user", "content": rid}]}, headers=headers
                        )
                        if response.status_code == 429:
                            refusals.append(response)
                            await asyncio.sleep(0.05)
                            continue
                        assert response.status_code == 200, response.text
                        ok_counts[rid] += 1

                tasks = [asyncio.create_task(agent(rid)) for rid in rollout_ids]
                while sum(ok_counts.values()) < 64:
                    await asyncio.sleep(0.01)
                paused = (
                    await client.post(
                        "/proxy/pause", json={"reason": "update", "retry_after_seconds": 1}, headers=ADMIN
                    )
                ).json()
                # Counted where calls are served: an agent may not have seen a reply sent before the pause yet.
                completed_at_pause = stub.behaviour.completed
                drained = (await client.get("/proxy/state", params={"wait_drained": 30}, headers=ADMIN)).json()
                assert drained["inflight"] == 0 and drained["paused"]
                deadline = time.monotonic() + 60
                # Everyone keeps knocking while paused; on a busy machine 64 refusals can take a while.
                while len(refusals) < 64:
                    assert time.monotonic() < deadline, f"only {len(refusals)} calls refused while paused"
                    await asyncio.sleep(0.05)
                # In-flight calls finished; no new call got through while paused.
                completed_while_paused = stub.behaviour.completed - completed_at_pause
                assert completed_while_paused <= paused["inflight"]
                assert len(refusals) >= 64
                for response in refusals:
                    assert response.headers["Retry-After"] == "1"
                    assert response.headers["X-Agl-Paused"] == "true"
                    assert response.json() == {"error": "gateway paused", "reason": "update"}
                await client.post("/proxy/resume", headers=ADMIN)
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
                assert (await client.get("/proxy/state", headers=ADMIN)).json()["inflight"] == 0
                for rid in rollout_ids:
                    events = (await client.get(f"/api/rollouts/{rid}/events", headers=ADMIN)).json()
                    assert len(events) == calls_per_agent  # every call recorded exactly once
                    assert len({e["event_id"] for e in events}) == calls_per_agent
                assert stub.behaviour.completed == 64 * calls_per_agent

        asyncio.run(scenario())


@pytest.mark.slow
def test_sigkill_mid_traffic_loses_nothing_acknowledged(tmp_path):
    store_path = str(tmp_path / "crash.db")
    gateway = GatewayProcess(store=store_path, admin_key=ADMIN_KEY).start()
    acknowledged_rollouts: set[str] = set()
    acknowledged_events: dict[str, int] = {}
    stop = threading.Event()

    def writer(worker: int) -> None:
        with httpx.Client(base_url=gateway.url, headers=ADMIN, timeout=5) as client:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    rid = f"w{worker}-{i}"
                    if client.post("/api/rollouts", json=[{"rollout_id": rid, "input": i}]).status_code != 201:
                        continue
                    acknowledged_rollouts.add(rid)
                    if client.patch(f"/api/rollouts/{rid}", json=RUN_A1).status_code != 200:
                        continue
                    response = client.post(
                        f"/api/rollouts/{rid}/attempt/a1/events", json={"event_type": "reward", "data": {"value": i}}
                    )
                    if response.status_code == 201:
                        acknowledged_events[rid] = response.json()["event_id"]
                except httpx.TransportError:
                    return

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acknowledged_rollouts) <= 40 and time.monotonic() < deadline:  # traffic in full swing
        time.sleep(0.05)
    gateway.kill()
    stop.set()
    for t in threads:
        t.join()
    assert len(acknowledged_rollouts) > 20

    restarted = GatewayProcess(store=store_path, admin_key=ADMIN_KEY, port=gateway.port).start()
    try:
        with httpx.Client(base_url=restarted.url, headers=ADMIN, timeout=10) as client:
            stored = {r["rollout_id"]: r for r in client.get("/api/rollouts").json()}
            assert acknowledged_rollouts <= set(stored)
            for rid, event_id in acknowledged_events.items():
                bundle = client.get(f"/api/rollouts/{rid}/events", params={"format": "samples"}).json()
                assert bundle["reward"] is not None
                assert event_id in {e["event_id"] for e in client.get(f"/api/rollouts/{rid}/events").json()}
            # the restarted gateway keeps working on the same file
            assert client.post("/api/rollouts", json=[{"input": "after"}]).status_code == 201
    finally:
        restarted.stop()


def test_sigkill_under_concurrent_event_posting_keeps_every_acknowledged_event(tmp_path):
    """Group commit answers a write only once its transaction is committed: whatever got a
    201 is in the file after a SIGKILL, however many writes were sharing a commit."""
    store_path = tmp_path / "events.db"
    gateway = GatewayProcess(store=str(store_path), admin_key=ADMIN_KEY).start()
    acknowledged: dict[int, tuple[str, dict]] = {}
    posters = 16

    async def scenario() -> None:
        async with httpx.AsyncClient(
            base_url=gateway.url, timeout=10, limits=httpx.Limits(max_connections=posters)
        ) as client:
            rollout_ids = await make_running_rollouts(client, posters)
            stop = asyncio.Event()

            async def post(rid: str) -> None:
                headers = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}
                n = 0
                while not stop.is_set():
                    n += 1
                    data = {"value": 1.0, "poster": rid, "n": n}
                    try:
                        response = await client.post(
                            f"/api/rollouts/{rid}/attempt/a1/events",
                            json={"event_type": "progress", "data": data},
                            headers=headers,
                        )
                    except httpx.TransportError:
                        return
                    assert response.status_code == 201, response.text
                    acknowledged[response.json()["event_id"]] = (rid, data)

            tasks = [asyncio.create_task(post(rid)) for rid in rollout_ids]
            deadline = time.monotonic() + 60
            while len(acknowledged) < 400 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            gateway.kill()  # while all 16 posters have calls in flight
            stop.set()
            await asyncio.gather(*tasks)

    try:
        asyncio.run(scenario())
    finally:
        gateway.kill()
    assert len(acknowledged) >= 400
    # Read the file as any other process would: a plain SQLite database.
    with sqlite3.connect(store_path) as conn:
        stored = {
            event_id: (rid, json.loads(data))
            for event_id, rid, data in conn.execute("SELECT event_id, rollout_id, data FROM events")
        }
    missing = [event_id for event_id in acknowledged if event_id not in stored]
    assert not missing, f"{len(missing)} acknowledged events lost, e.g. {missing[:5]}"
    assert all(stored[event_id] == expected for event_id, expected in acknowledged.items())
