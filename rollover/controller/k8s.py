"""Kubernetes runner: one `batch/v1` Job per attempt, rendered from a Jinja template.

The template sees `input`, `job_name`, `rollout_id` and `attempt_id`, plus a `yaml_escape`
filter. The controller then forces what it relies on: the name and namespace, its labels on
the Job and the pod template, `restartPolicy: Never`, `backoffLimit: 0`, the TTL, the
deadline, and the agent env in every container. Jobs are created through a token bucket
(`k8s.jobs_per_minute`) and followed by ONE watch over the controller's label, re-listed
after any error, so the API server sees no per-Job polling.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import jinja2
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from rollover.config import K8sRunnerConfig
from rollover.controller.controller import ControllerConfigError, LaunchError, LaunchSpec, Outcome
from rollover.store.models import Rollout

log = logging.getLogger("rollover.controller.k8s")

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "rollover"
ROLLOUT_LABEL = "rollover.dev/rollout-id"
ATTEMPT_LABEL = "rollover.dev/attempt-id"
SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"

TEMPLATE_KEY = "agentlightning.k8s.job_template_path"
ROLLOUT_TEMPLATE_KEY = "config.k8s.job_template"
WATCH_SECONDS = 300  # the server ends each watch after this; we re-list and watch again
MAX_NAME = 63


# -- names and the template ---------------------------------------------------------------

# YAML treats these as line breaks or refuses them even inside double quotes.
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")


def yaml_escape(value: Any) -> str:
    """A double-quoted scalar that YAML (and JSON) read back as exactly `str(value)`;
    dicts and lists are passed as their JSON text."""
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    quoted = json.dumps(text, ensure_ascii=False)
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", quoted)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def job_name_for(rollout_id: str, attempt_id: str) -> str:
    """A DNS-1123 label: `<rollout id>-<attempt id>` when that is one, else a cleaned,
    shortened form with a hash that keeps distinct ids apart."""
    raw = f"{rollout_id}-{attempt_id}"
    clean = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    if clean == raw and len(clean) <= MAX_NAME:
        return clean
    head = clean[: MAX_NAME - 9].strip("-") or "rollout"
    return f"{head}-{_short_hash(raw)}"


def label_value(text: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-")
    if clean == text and len(clean) <= MAX_NAME:
        return clean
    head = clean[: MAX_NAME - 9].strip("._-")
    return f"{head}-{_short_hash(text)}" if head else _short_hash(text)


class JobTemplateError(ControllerConfigError):
    pass


def _environment(strict: bool) -> jinja2.Environment:
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined if strict else jinja2.ChainableUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["yaml_escape"] = yaml_escape
    return env


_STRICT = _environment(strict=True)
_LENIENT = _environment(strict=False)


def _check_job(manifest: Any) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise ValueError(f"renders to {type(manifest).__name__}, not a YAML mapping")
    if manifest.get("apiVersion") != "batch/v1" or manifest.get("kind") != "Job":
        raise ValueError(
            f"must render to apiVersion: batch/v1, kind: Job (got apiVersion: {manifest.get('apiVersion')!r}, "
            f"kind: {manifest.get('kind')!r})"
        )
    if not isinstance(manifest.get("metadata", {}) or {}, dict):
        raise ValueError("metadata must be a mapping")
    spec = manifest.get("spec")
    template = spec.get("template") if isinstance(spec, dict) else None
    pod_spec = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(pod_spec, dict):
        raise ValueError("has no spec.template.spec")
    for key in ("containers", "initContainers"):
        containers = pod_spec.get(key) or []
        if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
            raise ValueError(f"spec.template.spec.{key} must be a list of mappings")
    if not pod_spec.get("containers"):
        raise ValueError("spec.template.spec.containers is empty")
    return manifest


class JobTemplate:
    """A Jinja-rendered Job manifest; `source` names it in errors."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        try:
            self._strict = _STRICT.from_string(text)
            self._lenient = _LENIENT.from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise JobTemplateError(f"{source}: Jinja syntax error on line {exc.lineno}: {exc.message}") from None

    @classmethod
    def from_path(cls, path: str | Path, key: str) -> JobTemplate:
        path = Path(path)
        if not path.is_file():
            raise JobTemplateError(f"{key}: Job template file not found: {path}")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise JobTemplateError(f"{key}: cannot read {path}: {exc}") from None
        return cls(text, f"{key} ({path})")

    def _load(self, rendered: str) -> dict[str, Any]:
        try:
            manifest = yaml.safe_load(rendered)
        except yaml.YAMLError as exc:
            raise ValueError(f"does not render to valid YAML: {exc}") from None
        return _check_job(manifest)

    def check(self) -> None:
        """Render with placeholder values (a missing input key renders empty) and check
        the result is a Job the controller can run."""
        try:
            rendered = self._lenient.render(input={}, job_name="check-a1", rollout_id="check", attempt_id="a1")
            build_job(
                self._load(rendered),
                job_name="check-a1",
                namespace="default",
                rollout_id="check",
                attempt_id="a1",
                env={},
                ttl_seconds=0,
                deadline_seconds=1,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise JobTemplateError(f"{self.source}: {exc}") from None

    def render(self, *, input: Any, job_name: str, rollout_id: str, attempt_id: str) -> dict[str, Any]:
        try:
            rendered = self._strict.render(input=input, job_name=job_name, rollout_id=rollout_id, attempt_id=attempt_id)
            return self._load(rendered)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise LaunchError(f"Job template {self.source}: {exc}", permanent=True) from None


def _inject_env(container: dict[str, Any], env: dict[str, str]) -> None:
    kept = [e for e in container.get("env") or [] if not (isinstance(e, dict) and e.get("name") in env)]
    container["env"] = kept + [{"name": name, "value": value} for name, value in env.items()]


def build_job(
    manifest: dict[str, Any],
    *,
    job_name: str,
    namespace: str,
    rollout_id: str,
    attempt_id: str,
    env: dict[str, str],
    ttl_seconds: int,
    deadline_seconds: int,
) -> dict[str, Any]:
    """The rendered manifest plus the fields the controller relies on."""
    job = copy.deepcopy(manifest)
    labels = {
        ROLLOUT_LABEL: label_value(rollout_id),
        ATTEMPT_LABEL: label_value(attempt_id),
        MANAGED_BY_LABEL: MANAGED_BY_VALUE,
    }
    metadata = job.get("metadata") or {}
    metadata.pop("generateName", None)
    metadata["name"] = job_name
    # Explicit, so that every watch event carries the namespace it was created in.
    metadata["namespace"] = namespace
    metadata["labels"] = {**(metadata.get("labels") or {}), **labels}
    job["metadata"] = metadata
    spec = job["spec"]
    spec["backoffLimit"] = 0
    spec["ttlSecondsAfterFinished"] = ttl_seconds
    spec["activeDeadlineSeconds"] = deadline_seconds
    pod = spec["template"]
    pod_metadata = pod.get("metadata") or {}
    pod_metadata["labels"] = {**(pod_metadata.get("labels") or {}), **labels}
    pod["metadata"] = pod_metadata
    pod_spec = pod["spec"]
    pod_spec["restartPolicy"] = "Never"
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            _inject_env(container, env)
    return job


# -- rate limit -----------------------------------------------------------------------------


class TokenBucket:
    """`rate` tokens per second, at most `capacity` saved up; `acquire` waits its turn (FIFO)."""

    def __init__(self, rate: float, capacity: float = 1.0) -> None:
        self.rate = rate
        self.capacity = capacity
        self._tokens = capacity
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()
        self.waiting = 0

    def _refill(self) -> None:
        now = time.monotonic()
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
                    if self._tokens >= 1.0:
                        self._tokens -= 1.0
                        return
                    await asyncio.sleep((1.0 - self._tokens) / self.rate)
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
        if not config.job_template_path:
            raise ControllerConfigError(f"{TEMPLATE_KEY} must be set to a Jinja Job template for the k8s runner")
        self.template = JobTemplate.from_path(config.job_template_path, TEMPLATE_KEY)
        self.template.check()
        if config.kubeconfig and not Path(config.kubeconfig).expanduser().is_file():
            raise ControllerConfigError(f"agentlightning.k8s.kubeconfig: file not found: {config.kubeconfig}")
        self._api = api_client
        self._own_api = api_client is None
        self._batch: Any = None
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
            ttl_seconds=self.config.ttl_seconds_after_finished,
            deadline_seconds=max(1, math.ceil(spec.timeout_seconds)),
        )
        execution = K8sExecution(self, name)
        # Registered before the create call, so that no watch event can slip past it.
        self._jobs[name] = execution
        try:
            await self._bucket.acquire()
            execution.created_at = time.monotonic()
            await self._create(job)
        except asyncio.CancelledError:
            self._jobs.pop(name, None)
            self._in_background(self.delete_job(name))  # the create may have gone through
            raise
        except ApiException as exc:
            self._jobs.pop(name, None)
            if exc.status == 409:
                self._in_background(self.delete_job(name))
            permanent = 400 <= (exc.status or 0) < 500 and exc.status not in (409, 429)
            raise LaunchError(f"cannot create Job {name}: {_api_reason(exc)}", permanent=permanent) from None
        except Exception as exc:
            self._jobs.pop(name, None)
            raise LaunchError(f"cannot create Job {name}: {exc!r}") from None
        log.debug("created Job %s for rollout %s attempt %s", name, rollout.rollout_id, spec.attempt_id)
        return execution

    async def _create(self, job: dict[str, Any]) -> None:
        for attempt in range(3):
            try:
                await self._batch.create_namespaced_job(self.config.namespace, job)
                return
            except Exception as exc:
                if attempt == 2 or not _transient_api(exc):
                    raise
                await asyncio.sleep(0.5 * 2**attempt)

    async def delete_job(self, name: str) -> None:
        for attempt in range(3):
            try:
                await self._batch.delete_namespaced_job(name, self.config.namespace, propagation_policy="Background")
                return
            except ApiException as exc:
                if exc.status == 404:
                    return
                if attempt == 2 or not _transient_api(exc):
                    log.warning("cannot delete Job %s: %s", name, _api_reason(exc))
                    return
            except Exception as exc:
                if attempt == 2 or not _transient_api(exc):
                    log.warning("cannot delete Job %s: %r", name, exc)
                    return
            await asyncio.sleep(0.5 * 2**attempt)

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
