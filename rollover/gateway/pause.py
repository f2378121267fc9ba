"""The proxy's pause/drain state: `paused`, `inflight` and `reason` under one lock, the held
and refused calls, and what a restarted gateway needs to go on pausing."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from rollover.store.models import ProxyState

# The longest wait a refused call is told: OpenAI's Python client does not retry at all when
# Retry-After exceeds two minutes (openai 3.63's MAX_RETRY_AFTER_DELAY), so a longer pause is
# ridden out in several waits of at most this, each answered with what is left.
MAX_ANNOUNCED_WAIT_SECONDS = 60.0


class ProxyPauseState:
    """`paused`, `inflight` and `reason`, guarded by one asyncio.Lock as in the seed."""

    def __init__(self, retry_after_seconds: float) -> None:
        self.paused = False
        self.reason: str | None = None
        self.retry_after_seconds = retry_after_seconds
        self.inflight = 0
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition(self._lock)
        self._paused_since: float | None = None
        self._paused_total = 0.0
        self._expected_end: float | None = None

    def _paused_seconds_total(self) -> float:
        running = time.monotonic() - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_total + running

    def _snapshot(self) -> ProxyState:
        return ProxyState(
            paused=self.paused,
            retry_after_seconds=self.retry_after_seconds,
            reason=self.reason,
            inflight=self.inflight,
            paused_seconds_total=round(self._paused_seconds_total(), 6),
        )

    async def pause(
        self, reason: str | None, retry_after_seconds: float, expected_seconds: float | None = None
    ) -> ProxyState:
        async with self._lock:
            if not self.paused:
                self._paused_since = time.monotonic()
            self.paused = True
            self.reason = reason
            self.retry_after_seconds = retry_after_seconds
            self._expected_end = None if expected_seconds is None else time.monotonic() + expected_seconds
            return self._snapshot()

    def retry_after(self) -> tuple[float, int | None]:
        """When a refused call should come back: Retry-After in seconds, and `retry-after-ms`
        (None when no length was announced: the seed's headers only). Never before the pause is
        expected to end (clients that come back early burn their retries) nor later than
        `MAX_ANNOUNCED_WAIT_SECONDS` from now, never sooner than the configured
        `retry_after_seconds`."""
        if self._expected_end is None:
            return self.retry_after_seconds, None
        left = min(self._expected_end - time.monotonic(), MAX_ANNOUNCED_WAIT_SECONDS)
        seconds = max(self.retry_after_seconds, left)
        return float(math.ceil(seconds)) if left > self.retry_after_seconds else seconds, math.ceil(seconds * 1000)

    async def resume(self) -> ProxyState:
        async with self._changed:
            if self._paused_since is not None:
                self._paused_total += time.monotonic() - self._paused_since
                self._paused_since = None
            self.paused = False
            self.reason = None
            self._expected_end = None
            self._changed.notify_all()  # held calls go on
            return self._snapshot()

    async def state(self, wait_drained: float | None = None) -> ProxyState:
        async with self._changed:
            if wait_drained:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.inflight == 0), wait_drained)
                except asyncio.TimeoutError:
                    pass
            return self._snapshot()

    async def try_enter(self, hold_seconds: float = 0.0) -> tuple[ProxyState, tuple[float, int | None]] | None:
        """Count a new call in flight, or, while paused, wait up to `hold_seconds` for the
        resume (a held call is not in flight: the drain does not wait for it) and then return
        the state that refuses it and when to come back (`retry_after`)."""
        async with self._changed:
            if self.paused and hold_seconds > 0:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: not self.paused), hold_seconds)
                except asyncio.TimeoutError:
                    pass
            if self.paused:
                return self._snapshot(), self.retry_after()
            # Counted under the lock pause() takes: a pause that begins after this line waits
            # for the call to drain like any other.
            self.inflight += 1
            return None

    async def leave(self) -> None:
        async with self._changed:
            self.inflight -= 1
            self._changed.notify_all()

    def record(self) -> dict[str, Any]:
        """What a restarted gateway needs to go on pausing as this one did (`restore`): the
        flag, its reason and lengths, and the paused time so far; times as wall-clock times,
        which outlive the process (a monotonic clock does not)."""
        now, wall = time.monotonic(), time.time()
        return {
            "paused": self.paused,
            "reason": self.reason,
            "retry_after_seconds": self.retry_after_seconds,
            "paused_total": self._paused_total,
            "paused_since": None if self._paused_since is None else wall - (now - self._paused_since),
            "expected_end": None if self._expected_end is None else wall + (self._expected_end - now),
        }

    def restore(self, record: dict[str, Any]) -> None:
        """Take over a `record` saved by an earlier gateway on the same store. The time it was
        down while paused counts as paused: the agents could not call either."""
        now, wall = time.monotonic(), time.time()
        self.paused = bool(record.get("paused"))
        self.reason = record.get("reason")
        self.retry_after_seconds = float(record.get("retry_after_seconds", self.retry_after_seconds))
        self._paused_total = float(record.get("paused_total") or 0.0)
        since, end = record.get("paused_since"), record.get("expected_end")
        self._paused_since = None if since is None or not self.paused else now - max(0.0, wall - since)
        self._expected_end = None if end is None or not self.paused else now + (end - wall)
