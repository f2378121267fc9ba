"""Kubernetes runner: one `batch/v1` Job per attempt, rendered from a Jinja template
(`job_template.py` says what a template sees and what the controller forces onto every Job).

Jobs are created through a token bucket (`k8s.jobs_per_minute`) and followed by ONE watch
over the controller's label, re-listed after any error, so the API server sees no per-Job
polling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from rollover.config import K8sRunnerConfig
from rollover.controller.job_template import (
    SELECTOR,
    JobTemplate,
    JobTemplateError,
    build_job,
    job_name_for,
    key_secret,
    key_secret_name,
)
from rollover.controller.runner import ControllerConfigError, LaunchError, LaunchSpec, Outcome
from rollover.retry import RetryPolicy, call_with_retries
from rollover.store.models import Rollout

log = logging.getLogger("rollover.controller.k8s")

TEMPLATE_KEY = "agentlightning.k8s.job_template_path"
ROLLOUT_TEMPLATE_KEY = "config.k8s.job_template"
WATCH_SECONDS = 300  # the server ends each watch after this; we re-list and watch again


# -- rate limit -----------------------------------------------------------------------------


class TokenBucket:
    """`rate` tokens per second, at most `capacity` saved up; `acquire` waits its turn (FIFO)."""

    def __init__(
        self,
        rate: float,
        capacity: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._sleep = sleep
        self._tokens = capacity
        self._stamp = clock()
        self._lock = asyncio.Lock()
        self.waiting = 0

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def available(self) -> float:
        self._refill()
        return self._tokens

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            async with self._lock:
                while True:
                    self._refill()
                    if self._tokens >= 1.0 - 1e-9:  # a refill that lands on 1.0 may round just under it
                        self._tokens = max(self._tokens - 1.0, 0.0)
                        return
                    await self._sleep((1.0 - self._tokens) / self.rate)
        finally:
            self.waiting -= 1


# -- the runner -----------------------------------------------------------------------------


def _api_reason(exc: ApiException) -> str:
    raw = exc.body
    body = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")


def _transient_api(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (0, 429) or (exc.status or 0) >= 500
    return isinstance(exc, (OSError, asyncio.TimeoutError, aiohttp.ClientError))


class K8sExecution:
    def __init__(self, runner: K8sRunner, job_name: str) -> None:
        self.runner = runner
        self.job_name = job_name
        self.created_at = time.monotonic()
        self._done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

    @property
    def finished(self) -> bool:
        return self._done.done()

    def finish(self, outcome: Outcome) -> None:
        if not self._done.done():
            self._done.set_result(outcome)
        self.runner._forget(self)

    async def wait(self) -> Outcome:
        return await asyncio.shield(self._done)

    async def kill(self) -> None:
        self.finish(Outcome(False, f"Job {self.job_name} deleted by the controller"))
        await self.runner.delete_job(self.job_name)


class K8sRunner:
    def __init__(self, config: K8sRunnerConfig, *, api_client: Any = None) -> None:
        self.config = config
        self.agent_gateway_url = config.gateway_url
        if not config.job_template_path:
            raise ControllerConfigError(f"{TEMPLATE_KEY} must be set to a Jinja Job template for the k8s runner")
        self.template = JobTemplate.from_path(config.job_template_path, TEMPLATE_KEY)
        self.template.check()
        if config.kubeconfig and not Path(config.kubeconfig).expanduser().is_file():
            raise ControllerConfigError(f"agentlightning.k8s.kubeconfig: file not found: {config.kubeconfig}")
        self._api = api_client
        self._own_api = api_client is None
        self._batch: Any = None
        self._core: Any = None
        self._bucket = TokenBucket(config.jobs_per_minute / 60.0)
        self._jobs: dict[str, K8sExecution] = {}
        self._templates: dict[str, JobTemplate] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # -- lifecycle --------------------------------------------------------------------------

    async def _new_api_client(self) -> Any:
        try:
            if self.config.kubeconfig:
                return await k8s_config.new_client_from_config(
                    config_file=str(Path(self.config.kubeconfig).expanduser())
                )
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                configuration = k8s_client.Configuration()
                k8s_config.load_incluster_config(client_configuration=configuration)
                return k8s_client.ApiClient(configuration)
            return await k8s_config.new_client_from_config()
        except (ConfigException, OSError, yaml.YAMLError) as exc:
            raise ControllerConfigError(
                f"agentlightning.k8s.kubeconfig: cannot configure the Kubernetes client ({exc}); set it to a "
                "kubeconfig file, or run the controller in a pod with a service account"
            ) from None

    async def start(self) -> None:
        if self._api is None:
            self._api = await self._new_api_client()
        self._batch = k8s_client.BatchV1Api(self._api)
        self._core = k8s_client.CoreV1Api(self._api)
        self._watch_task = asyncio.create_task(self._follow(), name="rollover-k8s-watch")

    async def stop(self) -> None:
        names = list(self._jobs)
        for execution in list(self._jobs.values()):
            execution.finish(Outcome(False, "the controller stopped"))
        if names:
            await asyncio.gather(*(self.delete_job(name) for name in names), return_exceptions=True)
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        if self._own_api and self._api is not None:
            await self._api.close()
            self._api = None

    def claim_budget(self, horizon_seconds: float) -> int:
        return math.floor(self._bucket.available() + horizon_seconds * self._bucket.rate) - self._bucket.waiting

    # -- jobs -------------------------------------------------------------------------------

    def _template_for(self, rollout: Rollout) -> JobTemplate:
        own = rollout.config.k8s.job_template
        if not own:
            return self.template
        if own not in self._templates:
            try:
                # A value with a line break is the template itself; anything else is a path.
                template = (
                    JobTemplate(own, ROLLOUT_TEMPLATE_KEY)
                    if "\n" in own
                    else JobTemplate.from_path(own, ROLLOUT_TEMPLATE_KEY)
                )
                template.check()
            except JobTemplateError as exc:
                raise LaunchError(str(exc), permanent=True) from None
            self._templates[own] = template
        return self._templates[own]

    async def launch(self, spec: LaunchSpec) -> K8sExecution:
        rollout = spec.rollout
        name = job_name_for(rollout.rollout_id, spec.attempt_id)
        manifest = self._template_for(rollout).render(
            input=rollout.input, job_name=name, rollout_id=rollout.rollout_id, attempt_id=spec.attempt_id
        )
        job = build_job(
            manifest,
            job_name=name,
            namespace=self.config.namespace,
            rollout_id=rollout.rollout_id,
            attempt_id=spec.attempt_id,
            env=spec.env,
            defaults=spec.defaults,
            ttl_seconds=self.config.ttl_seconds_after_finished,
            deadline_seconds=max(1, math.ceil(spec.timeout_seconds)),
        )
        execution = K8sExecution(self, name)
        # Registered before the create call, so that no watch event can slip past it.
        self._jobs[name] = execution
        try:
            await self._bucket.acquire()
            execution.created_at = time.monotonic()
            secret = key_secret(name, self.config.namespace, spec.env["AGL_KEY"], job["metadata"]["labels"])
            await self._create_secret(secret)
            created = await self._create(job)
            await self._own_secret(name, created)
        except asyncio.CancelledError:
            self._jobs.pop(name, None)
            self._in_background(self.delete_job(name))  # the create may have gone through
            raise
        except ApiException as exc:
            self._jobs.pop(name, None)
            # A Job that exists already is an earlier try's: it goes. The Secret goes either way.
            self._in_background(self.delete_job(name) if exc.status == 409 else self._delete_secret(name))
            permanent = 400 <= (exc.status or 0) < 500 and exc.status not in (409, 429)
            raise LaunchError(f"cannot create Job {name}: {_api_reason(exc)}", permanent=permanent) from None
        except Exception as exc:
            self._jobs.pop(name, None)
            self._in_background(self._delete_secret(name))
            raise LaunchError(f"cannot create Job {name}: {exc!r}") from None
        log.debug("created Job %s for rollout %s attempt %s", name, rollout.rollout_id, spec.attempt_id)
        return execution

    async def _create(self, job: dict[str, Any]) -> Any:
        return await call_with_retries(
            "creating a Job",
            lambda: self._batch.create_namespaced_job(self.config.namespace, job),
            RetryPolicy(_transient_api, attempts=3),
            log,
        )

    async def _create_secret(self, secret: dict[str, Any]) -> None:
        try:
            await call_with_retries(
                "creating a Job's key Secret",
                lambda: self._core.create_namespaced_secret(self.config.namespace, secret),
                RetryPolicy(_transient_api, attempts=3),
                log,
            )
        except ApiException as exc:
            if exc.status != 409:  # left by an earlier try of the same attempt: replace it
                raise
            await self._core.replace_namespaced_secret(secret["metadata"]["name"], self.config.namespace, secret)

    async def _own_secret(self, job_name: str, job: Any) -> None:
        """The Job owns its Secret: Kubernetes deletes the Secret with the Job (its TTL too)."""
        uid = getattr(getattr(job, "metadata", None), "uid", None)
        if not uid:
            return  # deleted with the Job by `delete_job` all the same
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": uid}
        try:
            await self._core.patch_namespaced_secret(
                key_secret_name(job_name), self.config.namespace, {"metadata": {"ownerReferences": [owner]}}
            )
        except ApiException as exc:
            log.warning("cannot make Job %s own its key Secret: %s", job_name, _api_reason(exc))

    async def _delete_secret(self, job_name: str) -> None:
        try:
            await self._core.delete_namespaced_secret(key_secret_name(job_name), self.config.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot delete the key Secret of Job %s: %s", job_name, _api_reason(exc))
        except Exception as exc:
            log.warning("cannot delete the key Secret of Job %s: %r", job_name, exc)

    async def delete_job(self, name: str) -> None:
        """Delete a Job, its pod and its key Secret; one that is gone already is fine, a
        failure is logged."""
        await self._delete_secret(name)
        try:
            await call_with_retries(
                f"deleting Job {name}",
                lambda: self._batch.delete_namespaced_job(name, self.config.namespace, propagation_policy="Background"),
                RetryPolicy(_transient_api, attempts=3),
                log,
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot delete Job %s: %s", name, _api_reason(exc))
        except Exception as exc:
            log.warning("cannot delete Job %s: %r", name, exc)

    async def extend_deadline(self, execution: Any, seconds: float) -> None:
        body = {"spec": {"activeDeadlineSeconds": int(math.ceil(seconds))}}
        await self._batch.patch_namespaced_job(execution.job_name, self.config.namespace, body)

    def _forget(self, execution: K8sExecution) -> None:
        if self._jobs.get(execution.job_name) is execution:
            del self._jobs[execution.job_name]

    def _in_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- following Jobs -----------------------------------------------------------------------

    def observe(self, event_type: str, job: dict[str, Any]) -> None:
        name = (job.get("metadata") or {}).get("name")
        execution = self._jobs.get(name) if isinstance(name, str) else None
        if execution is None or execution.finished:
            return
        if event_type == "DELETED":
            execution.finish(Outcome(False, f"Job {name} was deleted"))
            return
        for condition in (job.get("status") or {}).get("conditions") or []:
            if str(condition.get("status")) != "True":
                continue
            if condition.get("type") == "Complete":
                execution.finish(Outcome(True))
                return
            if condition.get("type") == "Failed":
                reason = condition.get("reason") or "Failed"
                message = condition.get("message")
                text = f"Job {name} failed: {reason}" + (f": {message}" if message else "")
                if reason == "DeadlineExceeded":
                    text = f"timeout: {text}"
                execution.finish(Outcome(False, text))
                return

    async def _list_jobs(self) -> dict[str, Any]:
        response = await self._batch.list_namespaced_job(
            self.config.namespace, label_selector=SELECTOR, _preload_content=False
        )
        try:
            if response.status >= 400:
                raise ApiException(status=response.status, reason=await response.text())
            return await response.json()
        finally:
            response.release()

    async def _follow(self) -> None:
        backoff = 0.5
        while True:
            try:
                listed_at = time.monotonic()
                listing = await self._list_jobs()
                seen = set()
                for job in listing.get("items") or []:
                    seen.add((job.get("metadata") or {}).get("name"))
                    self.observe("LISTED", job)
                for name, execution in list(self._jobs.items()):
                    # Created before this list, yet not in it: deleted while we were not watching.
                    if name not in seen and execution.created_at < listed_at:
                        execution.finish(Outcome(False, f"Job {name} disappeared"))
                kwargs: dict[str, Any] = {"label_selector": SELECTOR, "timeout_seconds": WATCH_SECONDS}
                version = (listing.get("metadata") or {}).get("resourceVersion")
                if version:
                    kwargs["resource_version"] = version
                async with k8s_watch.Watch(return_type="object") as watch:
                    async for event in watch.stream(self._batch.list_namespaced_job, self.config.namespace, **kwargs):
                        raw = event.get("raw_object")
                        if isinstance(raw, dict):
                            self.observe(str(event.get("type")), raw)
                        backoff = 0.5
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    continue  # our resourceVersion is too old: list again
                log.warning("Job watch failed (retrying in %.1fs): %s", backoff, _api_reason(exc))
            except Exception as exc:
                log.warning("Job watch failed (retrying in %.1fs): %r", backoff, exc)
            else:
                continue  # the server closed the watch at its timeout: list and watch again
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
