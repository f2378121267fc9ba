"""A gateway that dies comes back as it was: paused if it was, with its engines, on its port;
its clients ride the gap out, and a port taken by another server is not mistaken for it."""

from __future__ import annotations

import asyncio
import http.server
import json

import httpx
import pytest

from rollover.agent import AgentContext
from rollover.gateway import server as gateway_server
from rollover.gateway.client import GatewayClient
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayDied, GatewayProcess, GatewayThread, GatewayWatchdog, PortTaken
from rollover.processes import free_port
from tests.conftest import ADMIN_KEY, serve_http

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ENGINE = {"model": "policy", "endpoint": "http://127.0.0.1:9/v1", "policy_version": 3}


def _state(url: str) -> dict:
    return httpx.get(f"{url}/proxy/state", headers=ADMIN, timeout=30).json()


def _models(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/models", headers=ADMIN, timeout=30).json()


def test_a_gateway_on_an_existing_store_takes_over_its_pause_and_models(tmp_path):
    store = str(tmp_path / "store.db")
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as first:
        httpx.post(f"{first.url}/api/models", json=[ENGINE], headers=ADMIN).raise_for_status()
        httpx.post(
            f"{first.url}/proxy/pause", json={"reason": "update 7", "expected_seconds": 600}, headers=ADMIN
        ).raise_for_status()
        before = _state(first.url)
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as second:
        state = _state(second.url)
        assert state["paused"] and state["reason"] == "update 7"
        # The paused time goes on from where it was: a controller's timeouts keep not counting it.
        assert state["paused_seconds_total"] >= before["paused_seconds_total"]
        [model] = _models(second.url)
        assert (model["model"], model["endpoint"], model["policy_version"]) == ("policy", ENGINE["endpoint"], 3)
        # Still paused for agents too, and told to come back when the announced pause ends, in
        # waits of at most a minute (without the restored end there would be no retry-after-ms).
        created = httpx.post(f"{second.url}/api/rollouts", json=[{"input": {}}], headers=ADMIN).json()
        rid = created[0]["rollout_id"]
        running = {"status": {"state": "running", "last_attempt_id": "a1"}}
        httpx.patch(f"{second.url}/api/rollouts/{rid}", json=running, headers=ADMIN)
        refused = httpx.post(
            f"{second.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions",
            json={"messages": []},
            headers={"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"},
        )
        assert refused.status_code == 429 and int(refused.headers["retry-after-ms"]) == 60_000
        httpx.post(f"{second.url}/proxy/resume", headers=ADMIN).raise_for_status()
        httpx.delete(f"{second.url}/api/models", headers=ADMIN).raise_for_status()
    with GatewayThread(store=store, admin_key=ADMIN_KEY) as third:
        assert not _state(third.url)["paused"] and _models(third.url) == []


@pytest.mark.slow
async def test_the_client_and_the_agent_sdk_ride_out_a_gateway_that_is_down(tmp_path):
    port, store = free_port(), str(tmp_path / "store.db")
    url = f"http://127.0.0.1:{port}"
    async with GatewayClient(url, ADMIN_KEY, retry_seconds=120) as client:
        listing = asyncio.create_task(client.list_rollouts())
        enqueue = asyncio.create_task(client.enqueue([{"rollout_id": "r-late", "input": {}}]))
        await asyncio.sleep(1)  # both are retrying against a closed port by now
        assert not listing.done() and not enqueue.done()
        with GatewayThread(store=store, admin_key=ADMIN_KEY, port=port):
            await asyncio.wait_for(asyncio.gather(listing, enqueue), 60)
            assert [r.rollout_id for r in await client.list_rollouts()] == ["r-late"]
            await client.update_status("r-late", state="running", last_attempt_id="a1")
        # Down again: the SDK's reward post waits for the gateway to come back.
        context = AgentContext(
            openai_base_url=client.proxy_base_url("r-late", "a1"),
            event_url=client.event_url("r-late", "a1"),
            key=scoped_key(ADMIN_KEY, "r-late", "a1"),
        )
        reported = asyncio.create_task(asyncio.to_thread(context.report_reward, 0.5))
        await asyncio.sleep(1)
        assert not reported.done()
        with GatewayThread(store=store, admin_key=ADMIN_KEY, port=port):
            await asyncio.wait_for(reported, 60)
            assert (await client.triplets("r-late")).reward == 0.5


async def test_the_client_gives_up_after_its_retry_time():
    async with GatewayClient(f"http://127.0.0.1:{free_port()}", ADMIN_KEY, retry_seconds=1) as client:
        with pytest.raises(httpx.ConnectError):
            await client.list_rollouts()


@pytest.mark.slow
async def test_the_watchdog_restarts_a_killed_gateway_on_its_port_and_gives_up_after_max_restarts(tmp_path):
    gateway = GatewayProcess(store=str(tmp_path / "store.db"), admin_key=ADMIN_KEY, log_path=tmp_path / "g.log")
    gateway.start()
    try:
        watchdog = GatewayWatchdog(gateway, max_restarts=1)
        assert not await watchdog.check()
        url, first_pid = gateway.url, gateway.process.pid
        httpx.post(f"{url}/api/models", json=[ENGINE], headers=ADMIN).raise_for_status()
        httpx.post(f"{url}/proxy/pause", json={"reason": "mid-update"}, headers=ADMIN).raise_for_status()
        gateway.kill()
        assert await watchdog.check()
        assert gateway.url == url and gateway.process.pid != first_pid
        assert _state(url)["paused"] and _models(url)[0]["endpoint"] == ENGINE["endpoint"]
        gateway.kill()
        with pytest.raises(GatewayDied, match=r"gateway.max_restarts=1\): gateway process \d+ was killed by signal 9"):
            await watchdog.check()
    finally:
        gateway.stop()


@pytest.mark.slow
def test_a_picked_port_taken_by_another_server_is_given_up_for_another(tmp_path, foreign_server, monkeypatch):
    picks = iter([foreign_server])
    # The race, made certain: the port picked is the foreign server's, as if it bound it first.
    monkeypatch.setattr(gateway_server, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
    with GatewayProcess(store=str(tmp_path / "store.db"), admin_key=ADMIN_KEY) as gateway:
        assert gateway.port != foreign_server
        health = httpx.get(f"{gateway.url}/healthz").json()
        assert health["instance"] == gateway.settings.instance
        assert httpx.get(f"{gateway.url}/api/models", headers=ADMIN).json() == []


def test_a_port_asked_for_and_taken_is_an_error_naming_it(tmp_path, foreign_server):
    gateway = GatewayProcess(store=str(tmp_path / "store.db"), admin_key=ADMIN_KEY, port=foreign_server)
    with pytest.raises(PortTaken, match=f"port {foreign_server} .* taken by another server"):
        gateway.start()


@pytest.fixture
def gateway_that_drops_first_patches(gateway):
    """A proxy in front of the test gateway that hands on the first PATCH of each rollout to
    each state, then hangs up without answering: as if the gateway died after committing it."""
    dropped: list[tuple[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._relay("GET")

        def do_POST(self) -> None:
            self._relay("POST")

        def do_PATCH(self) -> None:
            self._relay("PATCH")

        def _relay(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {"Authorization": self.headers["Authorization"], "Content-Type": "application/json"}
            answer = httpx.request(method, gateway.url + self.path, content=body, headers=headers)
            change = (self.path, json.loads(body)["status"].get("state")) if method == "PATCH" else None
            if change is not None and change not in dropped:
                dropped.append(change)
                self.close_connection = True
                return
            self.send_response(answer.status_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        def log_message(self, *args: object) -> None:
            pass

    with serve_http(Handler) as port:
        yield f"http://127.0.0.1:{port}", dropped


async def test_a_claim_cut_off_after_its_commit_is_retried_and_a_requeue_is_not(gateway_that_drops_first_patches):
    url, dropped = gateway_that_drops_first_patches
    async with GatewayClient(url, ADMIN_KEY, retry_seconds=30) as client:
        await client.enqueue([{"rollout_id": "r-claim", "input": {}}, {"rollout_id": "r-requeue", "input": {}}])
        claimed = await client.update_status("r-claim", state="running", last_attempt_id="a1")
        assert claimed.state == "running" and claimed.status.last_attempt_id == "a1" and len(claimed.attempts) == 1
        await client.update_status("r-requeue", state="running", last_attempt_id="a1")
        with pytest.raises(httpx.RemoteProtocolError):
            await client.update_status("r-requeue", state="queuing")
        assert (await client.get_rollout("r-requeue")).state == "queuing"  # committed once, not repeated
    assert [state for _, state in dropped] == ["running", "running", "queuing"]
