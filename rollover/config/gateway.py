"""The `gateway` section: the store's REST API and the recording OpenAI proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rollover.config.base import Section


class GatewayConfig(Section):
    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    advertise_url: str | None = Field(
        default=None,
        description="URL other nodes use to reach the gateway (host 0.0.0.0 runs); null = http://host:port",
    )
    port: int = Field(default=0, ge=0, le=65535, description="0 = pick a free port (its URL is printed)")
    store: str | None = Field(
        default=None, description="SQLite file or :memory:; null = store.db in the run folder (or working directory)"
    )
    admin_key: str | None = Field(default=None, description="null = generated (and printed by `rollover gateway`)")
    retry_after_seconds: float = Field(default=5, ge=0, description="Retry-After sent to agents while paused")
    hold_while_paused: bool = Field(
        default=False,
        description="hold proxy calls that arrive during a pause and forward them at resume (not in flight for the drain); false = the seed's immediate 429",
    )
    max_hold_seconds: float = Field(
        default=600, gt=0, description="with hold_while_paused: a call held this long gets the seed's 429"
    )
    max_n: int | None = Field(
        default=None,
        gt=0,
        description="choices one proxied call may ask for (n); more get 400; null = actor_rollout_ref.rollout.n",
    )
    upstream_timeout_seconds: float = Field(default=600, gt=0, description="one engine call, at most")
    upstream_retries: int = Field(default=3, ge=0, description="retries of an engine call on 5xx or timeout")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_image_bytes: int = Field(
        default=8 * 1024 * 1024, gt=0, description="a proxied call's image (decoded) larger than this gets 400"
    )
    max_json_depth: int = Field(
        default=64, ge=1, le=200, description="request bodies nested deeper than this get 400 (the store keeps 254)"
    )
    max_connections: int = Field(
        default=512, gt=0, description="open client connections at most; more are closed as they are accepted"
    )
    header_timeout_seconds: float = Field(
        default=10, gt=0, description="a connection that has not sent a request's headers in this time is closed"
    )
    keep_alive_seconds: int = Field(default=30, ge=1, description="an idle keep-alive connection is closed after this")
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        default="NORMAL",
        description="NORMAL: acknowledged writes survive a process kill; FULL: a power loss too (an fsync per commit)",
    )
    drain_timeout_seconds: float = Field(
        default=300, gt=0, description="a drain slower than this is an error naming the stuck rollouts"
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="rollover train restarts a dead gateway (same port and store) this often, then the run stops",
    )

    def store_path(self, folder: str | Path) -> str:
        """`store`, or the default file in `folder` (the run folder)."""
        return self.store or str(Path(folder) / "store.db")
