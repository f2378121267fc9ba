"""The agent env contract: the AGL_* variables every agent gets, plus the `env_map` entries
read from its rollout's input (SPEC §3), and the standard variables through which unchanged
harnesses (the OpenAI and Anthropic SDKs, the Agents SDK, Claude Code, Codex) find the
attempt's proxy by themselves."""

from __future__ import annotations

import json
from collections.abc import Mapping
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


# Harnesses that phone home (telemetry, update checks, error reports, traces) would try the
# network on every start: off in an agent's environment unless the user's own env says otherwise.
QUIET_HARNESS_ENV = {
    "DISABLE_TELEMETRY": "1",  # Claude Code
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # Claude Code: updates, error reports, ...
    "DISABLE_AUTOUPDATER": "1",  # Claude Code
    # Claude Code opens its system prompt with a per-session attribution line: without it every
    # rollout's prompt is the same up to the task, so the engine's prefix cache holds across them.
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",  # the Agents SDK exports traces to api.openai.com
    "CODEX_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "OTEL_SDK_DISABLED": "true",
}


def harness_env(contract: dict[str, str]) -> dict[str, str]:
    """The standard variables, from an agent's `contract` (`agent_env`'s answer):
    `OPENAI_BASE_URL` (the attempt's `.../openai/v1`, read by the OpenAI SDK, the Agents SDK and
    Codex), `ANTHROPIC_BASE_URL` (its `.../anthropic`, read by the Anthropic SDK, the Claude Agent
    SDK and Claude Code, which append `/v1/messages`), both keys the attempt's key, and the
    harnesses' non-essential traffic off."""
    openai_url = contract["AGL_OPENAI_BASE_URL"]
    attempt_url = openai_url.removesuffix("/openai/v1")
    key = contract["AGL_KEY"]
    return {
        "OPENAI_BASE_URL": openai_url,
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": attempt_url + "/anthropic",
        "ANTHROPIC_API_KEY": key,
        **QUIET_HARNESS_ENV,
    }


# What an agent inherits of the controller's environment: what finds programs and speaks the
# locale, nothing else. The trainer's own variables (MASTER_ADDR, RANK, TORCHELASTIC_*, W&B,
# Hugging Face and cloud tokens, ...) never reach an agent; `local.env` adds what one needs.
BASE_ENV_NAMES = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "JAVA_HOME", "VIRTUAL_ENV")


def base_env(environ: Mapping[str, str], *, home: str | None = None) -> dict[str, str]:
    """The allowlisted part of `environ` (plus every `LC_*`); `home`, when given (the
    sandbox's scratch folder), is the agent's HOME and TMPDIR, else the controller's are kept."""
    env = {name: environ[name] for name in BASE_ENV_NAMES if name in environ}
    env.update({name: value for name, value in environ.items() if name.startswith("LC_")})
    if home is not None:
        env["HOME"] = env["TMPDIR"] = home
    else:
        env.update({name: environ[name] for name in ("HOME", "TMPDIR") if name in environ})
    return env
