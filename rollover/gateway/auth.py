"""Admin and per-rollout scoped keys.

A scoped key is an HMAC of the rollout id under the admin key: the gateway can check it
without storing anything, and it keeps working across gateway restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request

SCOPED_PREFIX = "rk-"


def new_admin_key() -> str:
    return "ak-" + secrets.token_urlsafe(24)


def scoped_key(admin_key: str, rollout_id: str) -> str:
    digest = hmac.new(admin_key.encode(), rollout_id.encode(), hashlib.sha256).hexdigest()
    return SCOPED_PREFIX + digest[:40]


def presented_key(request: Request) -> str | None:
    """The key from `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    authorization = request.headers.get("authorization", "")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


def is_admin(admin_key: str, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(key.encode(), admin_key.encode())


def may_access_rollout(admin_key: str, key: str | None, rollout_id: str) -> bool:
    if key is None:
        return False
    return is_admin(admin_key, key) or hmac.compare_digest(key.encode(), scoped_key(admin_key, rollout_id).encode())
