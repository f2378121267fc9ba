"""Job templates: a Jinja-rendered `batch/v1` Job manifest, checked once at start-up, and
the fields the controller forces onto every Job it creates.

A template sees `input`, `job_name`, `rollout_id` and `attempt_id`, plus a `yaml_escape`
filter. `build_job` then sets what the controller relies on: the name and namespace, its
labels on the Job and the pod template, `restartPolicy: Never`, `backoffLimit: 0`, the TTL,
the deadline, and the agent env in every container.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jinja2
import yaml

from rollover.controller.runner import ControllerConfigError, LaunchError

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "rollover"
ROLLOUT_LABEL = "rollover.dev/rollout-id"
ATTEMPT_LABEL = "rollover.dev/attempt-id"
SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"
MAX_NAME = 63

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


def _inject_env(container: dict[str, Any], env: dict[str, str], defaults: dict[str, str]) -> None:
    """`env` replaces the container's own variables of the same names; `defaults` are added only
    where the container sets no such variable (the template's own value wins)."""
    kept = [e for e in container.get("env") or [] if not (isinstance(e, dict) and e.get("name") in env)]
    own = {e.get("name") for e in kept if isinstance(e, dict)}
    added = {name: value for name, value in defaults.items() if name not in own and name not in env}
    container["env"] = kept + [{"name": name, "value": value} for name, value in {**added, **env}.items()]


def key_secret_name(job_name: str) -> str:
    """The Secret that holds a Job's attempt key (deleted with the Job)."""
    return f"{job_name}-key"


KEY_SECRET_ENTRY = "AGL_KEY"


def _key_from_secret(container: dict[str, Any], key: str, secret: str) -> None:
    """Every variable whose value is the attempt key (AGL_KEY, OPENAI_API_KEY, ...) reads it
    from the Job's Secret instead: the key never sits in clear in the Job's spec."""
    for entry in container.get("env") or []:
        if isinstance(entry, dict) and entry.get("value") == key:
            del entry["value"]
            entry["valueFrom"] = {"secretKeyRef": {"name": secret, "key": KEY_SECRET_ENTRY}}


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
    defaults: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The rendered manifest plus the fields the controller relies on: its labels, no retries,
    the TTL and deadline, the agent env (the attempt key from the Job's Secret) in every
    container, and no service-account token in the pod (an agent needs no Kubernetes API)."""
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
    pod_spec["automountServiceAccountToken"] = False
    key = env.get("AGL_KEY")
    for kind in ("initContainers", "containers"):
        for container in pod_spec.get(kind) or []:
            _inject_env(container, env, defaults or {})
            if key:
                _key_from_secret(container, key, key_secret_name(job_name))
    return job


def key_secret(job_name: str, namespace: str, key: str, labels: dict[str, str]) -> dict[str, Any]:
    """The Secret a Job's pod reads its attempt key from."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": key_secret_name(job_name), "namespace": namespace, "labels": labels},
        "type": "Opaque",
        "stringData": {KEY_SECRET_ENTRY: key},
    }
