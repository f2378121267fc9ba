"""The examples' agents through the Kubernetes runner, against kmock's Kubernetes emulator.

For every example agent in the tree: its Job template is rendered for a real rollout of a real
gateway, the real Controller creates the Job over HTTP with the official client, and the Job's
fate (Complete, Failed) decides the rollout's. The emulator runs no pods, so one more test
runs the calc agent's container the way a pod would: the Job's own command and env, as a
local process, against the gateway and a stand-in upstream.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from rollover.controller import Controller
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.store.models import RolloutCreate, RolloutState
from rollover.testing.stub_upstream import StubUpstream
from tests.controller.conftest import new_id, wait_for_rollout
from tests.controller.test_k8s_runner import NAMESPACE, POD_GATEWAY, Cluster, k8s_config

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_SECONDS = 300.5


@dataclass(frozen=True)
class Example:
    name: str
    agent_class: str

    @property
    def template(self) -> Path:
        own = ROOT / "examples" / self.name / "k8s_job.yaml.j2"
        return own if own.is_file() else ROOT / "examples" / "k8s" / f"{self.name}_job.yaml.j2"

    def task(self) -> dict[str, Any]:
        """A task input the way the example's data files hold it."""
        if self.name == "calc":
            from examples.calc.task import make_tasks

            return make_tasks(1, seed=0)[0]
        if self.name == "sw":
            from examples.sw.task import TASK_NAMES, make_tasks

            return make_tasks({n: {"train": [3], "val": []} for n in TASK_NAMES}, "train", 1)[0]
        return {"id": f"{self.name}-k8s-1", "question": 'What is "2 + 3"?\n# not a comment', "answer": "5"}


KNOWN = [
    Example("calc", "examples.calc.agent:CalcAgent"),
    Example("gsm8k", "examples.gsm8k.agent:GSM8KAgent"),
    Example("smith", "examples.smith.agent:SmithAgent"),
    Example("sw", "examples.sw.agent:SWAgent"),
]
EXAMPLES = [e for e in KNOWN if (ROOT / "examples" / e.name / "agent.py").is_file()]
CALC = KNOWN[0]


def container_of(job: dict[str, Any]) -> dict[str, Any]:
    containers = job["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "agent")


async def env_of(cluster: Cluster, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would give it: a `secretKeyRef` read from
    its Secret (the attempt key never sits in the Job itself)."""
    env = {}
    for entry in container.get("env") or []:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["secretKeyRef"]
        secret = await cluster.secret(ref["name"])
        assert secret is not None, f"the Secret {ref['name']} of {entry['name']} does not exist"
        env[entry["name"]] = secret["stringData"][ref["key"]]
    return env


async def enqueue(client: GatewayClient, example: Example, prefix: str) -> tuple[str, dict[str, Any]]:
    rollout_id = new_id(f"{example.name}-{prefix}")
    task = example.task()
    await client.enqueue([RolloutCreate(rollout_id=rollout_id, input=task)])
    return rollout_id, task


def test_every_example_with_an_agent_has_a_job_template() -> None:
    assert CALC in EXAMPLES
    for example in EXAMPLES:
        assert example.template.is_file(), f"{example.name}: no Job template at {example.template}"
        config = ROOT / "examples" / example.name / "config.yaml"
        if config.is_file():  # the template runs the class the example trains
            local = yaml.safe_load(config.read_text())["agentlightning"]["local"]
            assert local["agent_class"] == example.agent_class


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
async def test_example_agent_runs_as_a_job(example: Example, client: GatewayClient, cluster: Cluster) -> None:
    config = k8s_config(cluster, example.template, rollout_timeout_seconds=TIMEOUT_SECONDS)
    async with Controller(config, client, poll_interval=0.1):
        done_id, task = await enqueue(client, example, "ok")
        failed_id, _ = await enqueue(client, example, "bad")
        name = f"{done_id}-a1"
        job = await cluster.wait_job(name)
        await cluster.wait_job(f"{failed_id}-a1")
        running = await wait_for_rollout(client, done_id, lambda r: r.status.k8s_job_name is not None)
        assert running.state == RolloutState.RUNNING and running.status.k8s_job_name == name

        # the agent's command, from the example's template
        container = container_of(job)
        assert container["command"] == ["python", "-m", "rollover.controller.agent_main", example.agent_class]
        # the fields the controller forces
        labels = {
            "rollover.dev/rollout-id": done_id,
            "rollover.dev/attempt-id": "a1",
            "app.kubernetes.io/managed-by": "rollover",
        }
        assert job["metadata"]["name"] == name and job["metadata"]["namespace"] == NAMESPACE
        assert labels.items() <= job["metadata"]["labels"].items()
        assert labels.items() <= job["spec"]["template"]["metadata"]["labels"].items()
        assert job["spec"]["backoffLimit"] == 0
        assert job["spec"]["ttlSecondsAfterFinished"] == 120
        assert job["spec"]["activeDeadlineSeconds"] == math.ceil(TIMEOUT_SECONDS)
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        assert client.scoped_key(done_id, "a1") not in json.dumps(job)  # the key is in the Job's Secret
        assert job["metadata"]["annotations"]["rollover.dev/task-id"] == task["id"]
        # the injected agent env, pointing pods at the gateway's public address
        env = await env_of(cluster, container)
        assert env["AGL_OPENAI_BASE_URL"] == f"{POD_GATEWAY}/proxy/rollout/{done_id}/attempt/a1/mode/train/openai/v1"
        assert env["AGL_EVENT_URL"] == f"{POD_GATEWAY}/api/rollouts/{done_id}/attempt/a1/events"
        assert env["AGL_KEY"] == client.scoped_key(done_id, "a1")
        assert env["AGL_ROLLOUT_ID"] == done_id and env["AGL_ATTEMPT_ID"] == "a1"
        assert json.loads(env["AGL_ROLLOUT_INPUT"]) == task
        for other in job["spec"]["template"]["spec"].get("initContainers") or []:
            assert (await env_of(cluster, other))["AGL_KEY"] == env["AGL_KEY"]

        await cluster.set_condition(name, "Complete")
        await cluster.set_condition(
            f"{failed_id}-a1", "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        )
        done = await wait_for_rollout(client, done_id)
        failed = await wait_for_rollout(client, failed_id)
    assert done.state == RolloutState.SUCCEEDED, done.status
    assert failed.state == RolloutState.FAILED
    assert "BackoffLimitExceeded: Job has reached the specified backoff limit" in (failed.status.error_message or "")


async def test_the_calc_job_container_runs_as_a_pod_would(
    client: GatewayClient, cluster: Cluster, gateway: GatewayThread, stub: StubUpstream
) -> None:
    """The Job's command and env, and nothing of this process's env, are enough for the agent."""
    await client.register_models([{"model": "policy", "endpoint": stub.base_url}])
    config = k8s_config(cluster, CALC.template, k8s={"gateway_url": gateway.url})
    try:
        async with Controller(config, client, poll_interval=0.1):
            rollout_id, _ = await enqueue(client, CALC, "pod")
            name = f"{rollout_id}-a1"
            container = container_of(await cluster.wait_job(name))
            command = list(container["command"])
            assert command[0] == "python"
            command[0] = sys.executable  # the image's python: this environment's
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(await env_of(cluster, container))}
            assert container["workingDir"] == "/app"  # the image's copy of the repository: this one
            process = await asyncio.create_subprocess_exec(
                *command, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
            assert process.returncode == 0, output.decode(errors="replace")

            requests = await client.events(rollout_id, event_type="model_request")
            rewards = await client.events(rollout_id, event_type="reward")
            assert len(requests) == 1 and stub.behaviour.completed >= 1
            assert [e.data["value"] for e in rewards] == [0.0]  # the stub's "echo" is no answer
            assert {e.attempt_id for e in requests + rewards} == {"a1"}

            await cluster.set_condition(name, "Complete")
            done = await wait_for_rollout(client, rollout_id)
        assert done.state == RolloutState.SUCCEEDED, done.status
    finally:
        await client.clear_models()


async def test_the_shipped_network_policy_confines_every_agent_pod_to_the_gateway(
    client: GatewayClient, cluster: Cluster
) -> None:
    """The example NetworkPolicy selects the pods the controller starts, lets nothing in, and
    lets out only the gateway's port and DNS; the API server takes it."""
    from kubernetes_asyncio import client as k8s_client

    policy = yaml.safe_load((ROOT / "examples" / "k8s" / "networkpolicy.yaml").read_text())
    cluster.emulator.resources["networking.k8s.io/v1/networkpolicies"] = kmock.ResourceInfo(
        kind="NetworkPolicy", namespaced=True
    )
    networking = k8s_client.NetworkingV1Api(cluster.batch.api_client)
    await networking.create_namespaced_network_policy(NAMESPACE, policy)
    response = await networking.read_namespaced_network_policy(
        policy["metadata"]["name"], NAMESPACE, _preload_content=False
    )
    stored = await response.json()
    response.release()
    spec = stored["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and spec["ingress"] == []
    # Every agent pod the controller starts carries the labels the policy selects.
    config = k8s_config(cluster, CALC.template, rollout_timeout_seconds=TIMEOUT_SECONDS)
    async with Controller(config, client, poll_interval=0.1):
        rollout_id, _ = await enqueue(client, CALC, "policy")
        job = await cluster.wait_job(f"{rollout_id}-a1")
        await cluster.set_condition(f"{rollout_id}-a1", "Complete")
        await wait_for_rollout(client, rollout_id)
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    # Out: the gateway's one TCP port, and DNS; nothing else.
    ports = [(p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"]]
    assert sorted(ports) == [("TCP", 53), ("TCP", 8080), ("UDP", 53)]
    gateway_rule, dns_rule = spec["egress"]
    assert gateway_rule["to"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rollover-gateway"}}}]
    assert dns_rule["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert all("ipBlock" not in peer for rule in spec["egress"] for peer in rule["to"])
