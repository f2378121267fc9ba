"""The agent env contract: the AGL_* variables every agent gets, plus the `env_map` entries
read from its rollout's input (SPEC §3)."""

from __future__ import annotations

import json
from typing import Any

from rollover.controller.runner import LaunchError
from rollover.gateway.client import GatewayClient
from rollover.store.models import Rollout


def lookup_input_path(input_value: Any, path: str) -> Any:
    """`input.a.b.0` (or `a.b.0`) inside the rollout's input; KeyError names what is missing."""
    parts = [p for p in path.split(".") if p]
    if parts and parts[0] == "input":
        parts = parts[1:]
    current = input_value
    for index, part in enumerate(parts):
        where = ".".join(["input", *parts[: index + 1]])
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.lstrip("-").isdigit() and -len(current) <= int(part) < len(current):
            current = current[int(part)]
        else:
            raise KeyError(where)
    return current


def env_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def agent_env(
    client: GatewayClient,
    rollout: Rollout,
    attempt_id: str,
    env_map: dict[str, str],
    public_url: str | None = None,
) -> dict[str, str]:
    """The AGL_* variables plus `env_map`; `public_url` replaces the gateway's own URL (pods)."""
    rid = rollout.rollout_id
    proxy_url = client.proxy_base_url(rid, attempt_id, "train" if rollout.is_train else "val")
    event_url = client.event_url(rid, attempt_id)
    if public_url:
        public = public_url.rstrip("/")
        proxy_url = public + proxy_url[len(client.base_url) :]
        event_url = public + event_url[len(client.base_url) :]
    env = {
        "AGL_OPENAI_BASE_URL": proxy_url,
        "AGL_EVENT_URL": event_url,
        "AGL_KEY": client.scoped_key(rid, attempt_id),
        "AGL_ROLLOUT_ID": rid,
        "AGL_ATTEMPT_ID": attempt_id,
        "AGL_ROLLOUT_INPUT": json.dumps(rollout.input),
    }
    for name, path in env_map.items():
        try:
            env[name] = env_value(lookup_input_path(rollout.input, path))
        except KeyError as missing:
            raise LaunchError(
                f"env_map entry {name}: {path!r} names {missing.args[0]!r}, which the rollout's input lacks",
                permanent=True,
            ) from None
    return env
