"""The real peer: Agent Lightning 1.0.2's own local controller and its trainer-side gateway
calls, against Rollover's gateway on loopback. Every store API answer validates against
Agent Lightning's own pydantic schemas."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from rollover.gateway.server import GatewayProcess
from rollover.testing.stub_upstream import StubUpstream
from tests.agent_lightning_compat.conftest import agl_validate

pytestmark = pytest.mark.slow  # a real browser / the Agent Lightning peer: seconds per test

HERE = Path(__file__).resolve().parent
KEY = "peer-admin-key"

TRAINER_CALLS = """
import json, sys, time
from agentlightning.client import AgentLightningSyncClient
client = AgentLightningSyncClient(key=sys.argv[2], base_url=sys.argv[1], timeout=30)
paused = client.post_with_retry("/proxy/pause", json={"reason": "peer update", "retry_after_seconds": 5})
paused.raise_for_status()
deadline = time.monotonic() + 60
while True:
    state = client.get("/proxy/state").json()
    if state["inflight"] == 0 or time.monotonic() > deadline:
        break
    time.sleep(0.25)
resumed = client.post_with_retry("/proxy/resume", json={})
resumed.raise_for_status()
print(json.dumps({"paused": paused.json(), "drained": state, "resumed": resumed.json()}))
"""


@pytest.fixture
def peer_gateway(tmp_path):
    with StubUpstream() as stub, GatewayProcess(store=str(tmp_path / "store.db"), admin_key=KEY) as gateway:
        admin = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}]).raise_for_status()
        yield gateway, admin
        admin.close()


def test_agent_lightning_controller_runs_rollouts_on_rollover(agl_python, peer_gateway, tmp_path):
    gateway, admin = peer_gateway
    local = {"agent_class": "peer_agents.Agent", "env_map": {}}  # Agent Lightning's dotted form
    created = admin.post(
        "/api/rollouts",
        json=[{"input": {"q": i}, "config": {"timeout_seconds": 120, "local": local}} for i in range(2)],
    )
    assert created.status_code == 201
    agl_validate(agl_python, "Rollout", created.json(), many=True)
    ids = [r["rollout_id"] for r in created.json()]

    env = dict(os.environ, PYTHONPATH=str(HERE))
    controller = subprocess.Popen(
        [
            str(agl_python),
            "-m",
            "agentlightning.controller",
            "runner_type=local",
            f"agl_server.url={gateway.url}",
            f"agl_server.key={KEY}",
            "local_runner.poll_interval=1",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        env=env,
        cwd=tmp_path,
        stdout=open(tmp_path / "controller.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            rollouts = [admin.get(f"/api/rollouts/{rid}").json() for rid in ids]
            if all(r["status"]["state"] in ("succeeded", "failed") for r in rollouts):
                break
            time.sleep(1)
    finally:
        controller.terminate()
        controller.wait(30)
    log = (tmp_path / "controller.log").read_text(errors="replace")[-3000:]
    for rollout in rollouts:
        assert rollout["status"]["state"] == "succeeded", (rollout["status"], log)
        assert [a["attempt_id"] for a in rollout["attempts"]] == ["0"]  # Agent Lightning's attempt id
    agl_validate(agl_python, "Rollout", rollouts, many=True)
    listed = admin.get("/api/rollouts", params={"state_in": ["succeeded"]}).json()
    agl_validate(agl_python, "Rollout", listed, many=True)
    for rid in ids:
        events = admin.get(f"/api/rollouts/{rid}/events").json()
        agl_validate(agl_python, "Event", events, many=True)
        assert {e["event_type"] for e in events} == {"model_request", "reward"}
        assert all(e["attempt_id"] == "0" for e in events)
        triplet = admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
        agl_validate(agl_python, "Event", triplet, many=True)  # Agent Lightning's format=triplet: events
        [call] = [e["data"] for e in triplet if e["event_type"] == "model_request"]
        agl_validate(agl_python, "ModelRequestData", call)
        assert call["response_token_ids"] and call["request"] == {}  # trimmed for training
    agl_validate(agl_python, "Model", admin.get("/api/models").json(), many=True)

    # the trainer's side: pause, poll until drained, resume (as its _pause_and_drain_gateway does)
    out = subprocess.run(
        [str(agl_python), "-c", TRAINER_CALLS, gateway.url, KEY], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    calls = json.loads(out.stdout.strip().splitlines()[-1])
    assert calls["paused"]["paused"] is True and calls["drained"]["inflight"] == 0
    assert calls["resumed"]["paused"] is False
