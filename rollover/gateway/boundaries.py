"""Partial rollout, the gateway's side: which engines are frozen for a weight load, and where each
call in flight on an engine crosses that engine's weight loads.

An engine tells the gateway through its registration: `frozen: true` as it freezes its requests
(vLLM's `pause?mode=keep`), then its new `policy_version`, no longer frozen, once the new
weights are in and before its requests go on. Each engine's boundary is its own. While an
engine is frozen its calls' upstream deadlines stand still (the wait is the update's, not the
call's); at its new version every call streaming from it is marked, so each token is recorded
with the version that sampled it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from rollover.store.models import ModelEndpoint


class VersionedStream(Protocol):
    """A call streaming from an engine whose tokens' versions are followed (`StreamedCall`)."""

    def mark(self, version: int) -> int:
        """The engine's weights are now `version`; the tokens under way before it (0: none)."""
        ...


class Boundaries:
    """The streams in flight per engine URL, the frozen engines, and the counts the trainer reads
    (`GET /proxy/state`): calls and tokens that spanned a weight load, and the time some engine
    was frozen."""

    def __init__(self, freeze: Callable[[str], None], thaw: Callable[[str], None]) -> None:
        self._freeze = freeze  # stops the deadlines of calls to an engine
        self._thaw = thaw
        self._streams: dict[str, set[VersionedStream]] = {}
        self._frozen: set[str] = set()
        self._frozen_since: float | None = None
        self.frozen_seconds_total = 0.0  # wall time with at least one engine frozen
        self.calls_spanning_update_total = 0
        self.tokens_spanning_update_total = 0  # sampled before the load, in calls that went on after it

    def track(self, endpoint: str, stream: VersionedStream) -> None:
        self._streams.setdefault(endpoint, set()).add(stream)

    def untrack(self, endpoint: str, stream: VersionedStream) -> None:
        streams = self._streams.get(endpoint)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams[endpoint]

    def registered(self, before: ModelEndpoint | None, after: ModelEndpoint) -> None:
        """An engine (re-)registered: frozen, thawed, or at a new version."""
        url = after.endpoint
        if after.frozen and url not in self._frozen:
            self._set_frozen(url, True)
        if before is not None and before.policy_version != after.policy_version:
            for stream in list(self._streams.get(url, ())):
                under_way = stream.mark(after.policy_version)
                if under_way:
                    self.calls_spanning_update_total += 1
                    self.tokens_spanning_update_total += under_way
        if not after.frozen and url in self._frozen:
            self._set_frozen(url, False)

    def removed(self, url: str) -> None:
        """An engine left the registry: nothing of it stays frozen."""
        if url in self._frozen:
            self._set_frozen(url, False)

    def _set_frozen(self, url: str, frozen: bool) -> None:
        now = time.monotonic()
        if frozen:
            if not self._frozen:
                self._frozen_since = now
            self._frozen.add(url)
            self._freeze(url)
        else:
            self._frozen.discard(url)
            self._thaw(url)
            if not self._frozen and self._frozen_since is not None:
                self.frozen_seconds_total += now - self._frozen_since
                self._frozen_since = None

    def counts(self) -> dict[str, float]:
        """The `ProxyState` fields of partial rollout."""
        frozen_now = time.monotonic() - self._frozen_since if self._frozen_since is not None else 0.0
        return {
            "engine_frozen_seconds_total": round(self.frozen_seconds_total + frozen_now, 6),
            "calls_spanning_update_total": self.calls_spanning_update_total,
            "tokens_spanning_update_total": self.tokens_spanning_update_total,
        }
