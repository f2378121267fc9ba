"""The controller with the Kubernetes runner, against kmock's Kubernetes emulator over HTTP.

The emulator runs no pods: the tests play the Job controller by patching
`status.conditions`, and read Jobs back with the official async client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kubernetes_asyncio import client as k8s_client

from rollover.controller import Controller, ControllerConfigError
from rollover.controller.agent_env import QUIET_HARNESS_ENV
from rollover.controller.job_template import job_name_for, label_value, yaml_escape
from rollover.controller.k8s import TokenBucket
from rollover.gateway.client import GatewayClient
from rollover.gateway.server import GatewayThread
from rollover.store.models import RolloutCreate, RolloutState
from tests.controller.conftest import HandClock, make_config, new_id, wait_for_rollout, wait_until

NAMESPACE = "agents"
POD_GATEWAY = "http://gateway.cluster.local:8080"

TEMPLATE = """\
apiVersion: batch/v1
kind: Job
metadata:
  name: from-template
  labels:
    team: rl
spec:
  backoffLimit: 6
  template:
    metadata:
      annotations:
        question: {{ input.question | yaml_escape }}
    spec:
      restartPolicy: OnFailure
      initContainers:
        - name: init
          image: busybox
      containers:
        - name: agent
          image: agent:1
          args: ["--question", {{ input.question | yaml_escape }}, "--job", "{{ job_name }}"]
          env:
            - name: AGL_KEY
              value: stale
            - name: KEEP
              value: kept
            - name: DISABLE_TELEMETRY
              value: "0"
"""


class JobEmulator(kmock.KubernetesEmulator):
    """kmock's emulator, reading `watch=True` as a watch the way the API server does
    (kubernetes_asyncio spells the flag with a capital T), and timing Job creations."""

    async def __call__(self, raw_request: Any) -> Any:
        if raw_request.query.get("watch") == "True":
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.update_query(watch="true"))
        if raw_request.method == "POST" and raw_request.path.endswith("/jobs"):
            self.create_times.append(time.monotonic())
        return await super().__call__(raw_request)


class Cluster:
    def __init__(self, emulator: JobEmulator, url: str, kubeconfig: Path, api: k8s_client.ApiClient) -> None:
        self.emulator = emulator
        self.url = url
        self.kubeconfig = kubeconfig
        self.batch = k8s_client.BatchV1Api(api)
        self.core = k8s_client.CoreV1Api(api)

    @staticmethod
    async def _read(read: Any, name: str) -> dict[str, Any] | None:
        response = await read(name, NAMESPACE, _preload_content=False)
        try:
            return None if response.status == 404 else await response.json()
        finally:
            response.release()

    async def job(self, name: str) -> dict[str, Any] | None:
        return await self._read(self.batch.read_namespaced_job, name)

    async def secret(self, name: str) -> dict[str, Any] | None:
        return await self._read(self.core.read_namespaced_secret, name)

    async def wait_job(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (job := await self.job(name)) is None:
            assert time.monotonic() < deadline, f"Job {name} was never created"
            await asyncio.sleep(0.05)
        return job

    async def wait_deleted(self, name: str, timeout: float) -> float:
        started = time.monotonic()
        while await self.job(name) is not None:
            assert time.monotonic() - started < timeout, f"Job {name} still exists after {timeout}s"
            await asyncio.sleep(0.02)
        return time.monotonic() - started

    async def set_condition(self, name: str, type: str, reason: str | None = None, message: str | None = None) -> None:
        condition = {"type": type, "status": "True", "reason": reason, "message": message}
        body = {"status": {"conditions": [{k: v for k, v in condition.items() if v is not None}]}}
        await self.batch.patch_namespaced_job_status(name, NAMESPACE, body)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    emulator = JobEmulator()
    emulator.create_times = []
    async with emulator, kmock.Server(emulator) as server:
        emulator.resources["batch/v1/jobs"] = kmock.ResourceInfo(kind="Job", namespaced=True)
        emulator.resources["v1/secrets"] = kmock.ResourceInfo(kind="Secret", namespaced=True)
        url = str(server.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                    "users": [{"name": "test", "user": {"token": "test-token"}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "test", "namespace": NAMESPACE}}
                    ],
                    "current-context": "kmock",
                }
            )
        )
        async with k8s_client.ApiClient(k8s_client.Configuration(host=url)) as api:
            yield Cluster(emulator, url, kubeconfig, api)


def k8s_config(cluster: Cluster, template: Path, **settings: Any) -> Any:
    k8s = {
        "job_template_path": str(template),
        "namespace": NAMESPACE,
        "kubeconfig": str(cluster.kubeconfig),
        "jobs_per_minute": 6000,
        "ttl_seconds_after_finished": 120,
        "gateway_url": POD_GATEWAY,
        **settings.pop("k8s", {}),
    }
    return make_config(runner="k8s", k8s=k8s, **settings)


@pytest.fixture
def template(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml.j2"
    path.write_text(TEMPLATE)
    return path


@asynccontextmanager
async def controller(
    client: GatewayClient, cluster: Cluster, template: Path, clock: HandClock | None = None, **settings: Any
) -> AsyncIterator[Controller]:
    config = k8s_config(cluster, template, **settings)
    async with Controller(config, client, poll_interval=0.1, clock=clock or time.monotonic) as running:
        yield running


async def enqueue(client: GatewayClient, prefix: str, input: Any = None, **fields: Any) -> str:
    rollout_id = new_id(prefix)
    await client.enqueue([RolloutCreate(rollout_id=rollout_id, input=input or {"question": "q"}, **fields)])
    return rollout_id


async def test_job_manifest_is_the_template_plus_forced_fields(
    client: GatewayClient, cluster: Cluster, template: Path, gateway: GatewayThread
) -> None:
    question = 'He said: "hi" # not a comment\n  - and: {braces}'
    async with controller(client, cluster, template, rollout_timeout_seconds=90.5):
        rollout_id = await enqueue(client, "manifest", {"question": question})
        name = f"{rollout_id}-a1"
        job = await cluster.wait_job(name)
        running = await wait_for_rollout(client, rollout_id, lambda r: r.status.k8s_job_name is not None)
        assert running.status.k8s_job_name == name

        labels = {
            "rollover.dev/rollout-id": rollout_id,
            "rollover.dev/attempt-id": "a1",
            "app.kubernetes.io/managed-by": "rollover",
        }
        proxy = f"{POD_GATEWAY}/proxy/rollout/{rollout_id}/attempt/a1/mode/train"
        key = client.scoped_key(rollout_id, "a1")
        # The standard variables harnesses read, where the template sets none of its own.
        standard = {
            "OPENAI_BASE_URL": proxy + "/openai/v1",
            "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": proxy + "/anthropic",
            "ANTHROPIC_API_KEY": key,
        } | QUIET_HARNESS_ENV
        env = [
            {"name": "KEEP", "value": "kept"},
            {"name": "DISABLE_TELEMETRY", "value": "0"},
            *({"name": k, "value": v} for k, v in standard.items() if k != "DISABLE_TELEMETRY"),
            {
                "name": "AGL_OPENAI_BASE_URL",
                "value": f"{POD_GATEWAY}/proxy/rollout/{rollout_id}/attempt/a1/mode/train/openai/v1",
            },
            {"name": "AGL_EVENT_URL", "value": f"{POD_GATEWAY}/api/rollouts/{rollout_id}/attempt/a1/events"},
            {"name": "AGL_KEY", "value": client.scoped_key(rollout_id, "a1")},
            {"name": "AGL_ROLLOUT_ID", "value": rollout_id},
            {"name": "AGL_ATTEMPT_ID", "value": "a1"},
            {"name": "AGL_ROLLOUT_INPUT", "value": json.dumps({"question": question})},
        ]
        init_env = [{"name": k, "value": v} for k, v in standard.items()] + env[2 + len(standard) - 1 :]
        # The attempt key is read from the Job's own Secret, never written in the Job.
        from_secret = {"secretKeyRef": {"name": f"{name}-key", "key": "AGL_KEY"}}
        env, init_env = (
            [{"name": e["name"], "valueFrom": from_secret} if e.get("value") == key else e for e in entries]
            for entries in (env, init_env)
        )
        expected = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"team": "rl", **labels}},
            "spec": {
                "backoffLimit": 0,
                "ttlSecondsAfterFinished": 120,
                "activeDeadlineSeconds": 91,
                "template": {
                    "metadata": {"annotations": {"question": question}, "labels": labels},
                    "spec": {
                        "restartPolicy": "Never",
                        "automountServiceAccountToken": False,
                        "initContainers": [{"name": "init", "image": "busybox", "env": init_env}],
                        "containers": [
                            {
                                "name": "agent",
                                "image": "agent:1",
                                "args": ["--question", question, "--job", name],
                                "env": env,
                            }
                        ],
                    },
                },
            },
        }
        assert job == expected
        assert key not in json.dumps(job)
        secret = await cluster.secret(f"{name}-key")
        assert secret is not None and secret["stringData"] == {"AGL_KEY": key}
        assert secret["metadata"]["labels"] == {"team": "rl", **labels}

        await cluster.set_condition(name, "Complete")
        done = await wait_for_rollout(client, rollout_id)
    assert done.state == RolloutState.SUCCEEDED, done.status


async def test_failed_conditions_fail_the_rollout(client: GatewayClient, cluster: Cluster, template: Path) -> None:
    async with controller(client, cluster, template):
        failed_id = await enqueue(client, "failed")
        deadline_id = await enqueue(client, "deadline")
        await cluster.wait_job(f"{failed_id}-a1")
        await cluster.wait_job(f"{deadline_id}-a1")
        await cluster.set_condition(
            f"{failed_id}-a1", "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        )
        await cluster.set_condition(
            f"{deadline_id}-a1", "Failed", "DeadlineExceeded", "Job was active longer than specified deadline"
        )
        failed = await wait_for_rollout(client, failed_id)
        deadline = await wait_for_rollout(client, deadline_id)
    assert failed.state == RolloutState.FAILED
    assert "BackoffLimitExceeded: Job has reached the specified backoff limit" in (failed.status.error_message or "")
    assert deadline.state == RolloutState.FAILED
    assert (deadline.status.error_message or "").startswith("timeout")
    assert "DeadlineExceeded" in (deadline.status.error_message or "")


async def test_abort_deletes_the_job_promptly(client: GatewayClient, cluster: Cluster, template: Path) -> None:
    async with controller(client, cluster, template) as running:
        rollout_id = await enqueue(client, "abort")
        name = f"{rollout_id}-a1"
        await cluster.wait_job(name)
        assert await cluster.secret(f"{name}-key") is not None
        await client.update_status(rollout_id, state=RolloutState.FAILED, error_message="aborted: test")
        # Promptly: within a few ticks, not at the Job's deadline (30 min).
        await cluster.wait_deleted(name, timeout=10.0)
        await wait_until(lambda: rollout_id not in running.running)  # the controller is done with it
        assert await cluster.secret(f"{name}-key") is None  # the attempt key went with its Job
        rollout = await client.get_rollout(rollout_id)
    assert rollout.state == RolloutState.FAILED and rollout.status.error_message == "aborted: test"


async def test_timeout_deletes_the_job(client: GatewayClient, cluster: Cluster, template: Path) -> None:
    clock = HandClock()
    clock.hold()  # the Job is seen before its 0.5 s are up, however slow this machine is
    async with controller(client, cluster, template, clock=clock):
        rollout_id = await enqueue(client, "timeout", config={"timeout_seconds": 0.5})
        name = f"{rollout_id}-a1"
        job = await cluster.wait_job(name)
        assert job["spec"]["activeDeadlineSeconds"] == 1
        clock.advance(1.0)  # twice its budget
        done = await wait_for_rollout(client, rollout_id)
        await cluster.wait_deleted(name, timeout=10.0)  # deleted before the report: only the read lags
    assert done.state == RolloutState.FAILED
    assert (done.status.error_message or "").startswith("timeout")


async def test_pause_pushes_the_job_deadline_out(client: GatewayClient, cluster: Cluster, template: Path) -> None:
    async with controller(client, cluster, template, rollout_timeout_seconds=30):
        rollout_id = await enqueue(client, "pause")
        name = f"{rollout_id}-a1"
        assert (await cluster.wait_job(name))["spec"]["activeDeadlineSeconds"] == 30
        before = (await client.proxy_state()).paused_seconds_total
        await client.pause(reason="update")
        await asyncio.sleep(0.5)
        paused = (await client.resume()).paused_seconds_total - before
        deadline = time.monotonic() + 10
        while (await cluster.job(name) or {})["spec"]["activeDeadlineSeconds"] == 30:
            assert time.monotonic() < deadline, "the Job's deadline was never extended"
            await asyncio.sleep(0.05)
        extended = (await cluster.job(name) or {})["spec"]["activeDeadlineSeconds"]
        # By the time paused (as long as this machine made it), plus the controller's headroom.
        assert paused >= 0.5 and 30 + paused + 60 <= extended <= 30 + paused + 61
        await cluster.set_condition(name, "Complete")
        assert (await wait_for_rollout(client, rollout_id)).state == RolloutState.SUCCEEDED


@pytest.mark.slow
async def test_jobs_are_created_no_faster_than_the_rate_limit(
    client: GatewayClient, cluster: Cluster, template: Path
) -> None:
    count, per_minute = 3, 30  # one Job per 2 s: scheduling jitter stays well inside the margins
    async with controller(client, cluster, template, k8s={"jobs_per_minute": per_minute}):
        ids = [await enqueue(client, "rate") for _ in range(count)]
        for rollout_id in ids:
            await cluster.wait_job(f"{rollout_id}-a1")
        times = sorted(cluster.emulator.create_times)
        for rollout_id in ids:
            await cluster.set_condition(f"{rollout_id}-a1", "Complete")
        for rollout_id in ids:
            assert (await wait_for_rollout(client, rollout_id)).state == RolloutState.SUCCEEDED
    assert len(times) == count
    spacing = 60 / per_minute
    # Arrival times at the API server carry scheduling jitter on a loaded machine: check the
    # overall rate, and that no two Jobs came anywhere near a burst.
    assert times[-1] - times[0] >= (count - 1) * spacing - spacing / 2, times
    for earlier, later in zip(times, times[1:]):
        assert later - earlier >= spacing / 2, times
    assert times[-1] - times[0] < (count - 1) * spacing + spacing  # and not much slower either


@pytest.mark.parametrize("own_keys", [True, False], ids=["k8s-keys", "local-fallback"])
async def test_the_k8s_runner_has_its_own_concurrency_and_env_map(
    client: GatewayClient, cluster: Cluster, template: Path, own_keys: bool, caplog: pytest.LogCaptureFixture
) -> None:
    if own_keys:
        local = {"max_concurrency": 5, "env_map": {"LOCAL_Q": "input.question"}}
        k8s = {"max_concurrency": 1, "env_map": {"JOB_Q": "input.question"}}
        injected, absent = "JOB_Q", "LOCAL_Q"
    else:  # the keys it read before it had its own still apply (deprecated)
        local, k8s = {"max_concurrency": 1, "env_map": {"LOCAL_Q": "input.question"}}, {}
        injected, absent = "LOCAL_Q", "JOB_Q"
    async with controller(client, cluster, template, local=local, k8s=k8s):
        ids = [new_id("limit") for _ in range(2)]
        # One enqueue: without the limit, one tick would claim both before either Job exists.
        await client.enqueue([RolloutCreate(rollout_id=r, input={"question": f"q-{r}"}) for r in ids])
        for _ in ids:
            deadline = time.monotonic() + 20
            while True:
                running = [r for r in await client.list_rollouts(rollout_ids=ids) if r.state == RolloutState.RUNNING]
                if any(r.status.k8s_job_name for r in running):
                    break
                assert time.monotonic() < deadline, "no Job was created"
                await asyncio.sleep(0.05)
            [rollout] = running  # one at a time
            name = rollout.status.k8s_job_name
            assert name is not None
            job = await cluster.wait_job(name)
            env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env[injected] == f"q-{rollout.rollout_id}" and absent not in env
            await cluster.set_condition(name, "Complete")
            assert (await wait_for_rollout(client, rollout.rollout_id)).state == RolloutState.SUCCEEDED
    deprecated = [r for r in caplog.records if "the fallback is deprecated" in r.getMessage()]
    assert len(deprecated) == (0 if own_keys else 2)  # max_concurrency and env_map


async def test_stop_deletes_running_jobs(client: GatewayClient, cluster: Cluster, template: Path) -> None:
    async with controller(client, cluster, template):
        ids = [await enqueue(client, "stop") for _ in range(2)]
        for rollout_id in ids:
            await cluster.wait_job(f"{rollout_id}-a1")
    for rollout_id in ids:
        assert await cluster.job(f"{rollout_id}-a1") is None
        assert (await client.get_rollout(rollout_id)).state == RolloutState.QUEUING
        await client.update_status(rollout_id, state=RolloutState.FAILED, error_message="aborted: test over")


async def test_a_rollout_can_bring_its_own_template(client: GatewayClient, cluster: Cluster, template: Path) -> None:
    own = TEMPLATE.replace("image: agent:1", "image: other:2")
    async with controller(client, cluster, template):
        rollout_id = await enqueue(client, "own", config={"k8s": {"job_template": own}})
        bad_id = await enqueue(client, "own-bad", config={"k8s": {"job_template": "/no/such/template.j2"}})
        job = await cluster.wait_job(f"{rollout_id}-a1")
        bad = await wait_for_rollout(client, bad_id)
        await cluster.set_condition(f"{rollout_id}-a1", "Complete")
        await wait_for_rollout(client, rollout_id)
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "other:2"
    assert bad.state == RolloutState.FAILED
    assert "config.k8s.job_template" in (bad.status.error_message or "")


@pytest.mark.parametrize(
    "text, fragment",
    [
        (None, "not found"),
        ("apiVersion: v1\nkind: Pod\nspec: {}\n", "batch/v1"),
        (
            "apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n      containers: []\n",
            "containers is empty",
        ),
        ("apiVersion: batch/v1\nkind: Job\nspec: {{ job_name\n", "Jinja syntax error"),
        ("apiVersion: batch/v1\nkind: Job\nspec: [unclosed\n", "valid YAML"),
    ],
)
async def test_bad_template_is_a_clear_error_at_construction(
    client: GatewayClient, cluster: Cluster, tmp_path: Path, text: str | None, fragment: str
) -> None:
    path = tmp_path / "bad.yaml.j2"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ControllerConfigError) as info:
        Controller(k8s_config(cluster, path), client)
    assert "agentlightning.k8s.job_template_path" in str(info.value)
    assert fragment in str(info.value)


async def test_missing_template_path_is_a_clear_error(client: GatewayClient) -> None:
    with pytest.raises(ControllerConfigError, match="agentlightning.k8s.job_template_path"):
        Controller(make_config(runner="k8s"), client)


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        'quote " and \\ backslash',
        "a: b\n- c\n# d",
        "tab\tnel\x85ls\u2028",
        "emoji 😀 漢字",
        "yes",
        "null",
        "123",
        "",
        7,
        True,
        None,
        {"nested": [1, "two"]},
    ],
)
def test_yaml_escape_round_trips(value: Any) -> None:
    expected = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    assert yaml.safe_load(f"key: {yaml_escape(value)}\n") == {"key": expected}
    assert json.loads(yaml_escape(value)) == expected


def test_job_names_are_dns_labels_and_distinct() -> None:
    import re

    ids = ["r-1", "R_1", "r.1", "x" * 200, "x" * 199 + "y", "a:b"]
    names = {job_name_for(rid, "a1") for rid in ids}
    assert len(names) == len(ids)
    for name in names:
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert job_name_for("r-1", "a2") == "r-1-a2"
    for text in ["ok", "a:b", "x" * 100, "-lead"]:
        value = label_value(text)
        assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", value), value


async def test_token_bucket_spacing() -> None:
    now = 0.0

    async def sleep(seconds: float) -> None:
        nonlocal now
        now += seconds

    bucket = TokenBucket(rate=20.0, clock=lambda: now, sleep=sleep)  # one per 50 ms
    for _ in range(5):
        await bucket.acquire()
    assert now == pytest.approx(0.2)  # the first token was saved up; four waits of 50 ms
    now += 10.0
    assert bucket.available() == 1.0  # at most `capacity` saved up


def test_the_shipped_example_template_renders() -> None:
    from importlib import resources

    from rollover.controller.job_template import JobTemplate

    path = resources.files("rollover.controller").joinpath("templates/agent_job.yaml.j2")
    template = JobTemplate.from_path(str(path), "example")
    template.check()
    job = template.render(input={"question": 'a "quoted": question'}, job_name="r-a1", rollout_id="r", attempt_id="a1")
    assert job["spec"]["template"]["spec"]["containers"][0]["env"][0] == {
        "name": "TASK_QUESTION",
        "value": 'a "quoted": question',
    }
