"""The gateway around an update (SPEC §4 steps 2 and 5): resumed as each rollout begins, paused
and drained before the update, so no call of the old policy is in flight while it changes.

With partial rollout nothing is paused or waited for: the calls in flight go on during the
update, each engine freezing them only across its weight load.
"""

from __future__ import annotations

from collections.abc import Callable

from rollover.gateway.client import GatewayClient, is_transient
from rollover.metrics.progress import Progress
from rollover.retry import RetryPolicy, call_with_retries
from rollover.store.models import ProxyState, RolloutState
from rollover.training.gateway_counts import unhonoured_metrics


class DrainTimeout(RuntimeError):
    """The gateway did not drain in `gateway.drain_timeout_seconds`."""


class GatewayPause:
    """Pauses and resumes the gateway for the updates of one run, and remembers how long the
    last pause lasted: the next is announced as lasting about as long, so refused agents come
    back when it ends, not `Retry-After` later."""

    def __init__(
        self,
        client: GatewayClient,
        *,
        partial_rollout: bool,
        retry_after_seconds: float,
        drain_timeout_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self.client = client
        self.partial_rollout = partial_rollout
        self.retry_after_seconds = retry_after_seconds
        self.drain_timeout_seconds = drain_timeout_seconds
        self.clock = clock
        self.paused_at: float | None = None
        self.last_pause_seconds: float | None = None  # pause -> resume, measured at the resume
        self.boundary_counts: ProxyState | None = None  # partial rollout: the gateway's, at the update
        self.counts: ProxyState | None = None  # the gateway's totals at the last pause
        self._counts_reported: ProxyState | None = None  # ...and at the one `unhonoured` last reported

    async def resume(self, attempts: int = 5) -> None:
        """Resume (idempotent, retried); the pause it ends is measured."""
        await call_with_retries(
            "resuming the gateway", self.client.resume, RetryPolicy(is_transient, attempts=attempts)
        )
        if self.paused_at is not None:
            self.last_pause_seconds = self.clock() - self.paused_at
            self.paused_at = None

    def unhonoured(self) -> dict[str, float]:
        """This step's `gateway/unhonoured_fields/*` (`gateway_counts`): from the pause last
        reported to this step's."""
        if self.counts is None:
            return {}
        metrics = unhonoured_metrics(self._counts_reported, self.counts)
        self._counts_reported = self.counts
        return metrics

    async def pause_and_drain(self, step: int, progress: Progress) -> tuple[int, float]:
        """Pause the proxy, record the calls in flight at that moment, wait until none are
        left: `(inflight at the pause, seconds of the drain)`. Raises `DrainTimeout` naming the
        running rollouts when the drain outlasts `gateway.drain_timeout_seconds`.

        With partial rollout the drain is the time to read the gateway's state (calls in flight,
        and its partial-rollout counts, which the step's metrics take the difference of)."""
        if self.partial_rollout:
            started = self.clock()
            self.boundary_counts = self.counts = await self.client.proxy_state()
            return self.boundary_counts.inflight, self.clock() - started
        state = await self.client.pause(
            reason=f"policy update at step {step}",
            retry_after_seconds=self.retry_after_seconds,
            expected_seconds=self.last_pause_seconds,
        )
        inflight_at_pause = state.inflight
        self.counts = state
        started = self.paused_at = self.clock()
        deadline = started + self.drain_timeout_seconds
        progress.drain(state.inflight)
        while state.inflight > 0:
            remaining = deadline - self.clock()
            if remaining <= 0:
                running = await self.client.list_rollouts(state_in=[RolloutState.RUNNING])
                stuck = ", ".join(r.rollout_id for r in running[:20]) or "none running"
                raise DrainTimeout(
                    f"gateway still has {state.inflight} call(s) in flight after "
                    f"gateway.drain_timeout_seconds={self.drain_timeout_seconds}; running rollouts: {stuck}"
                )
            state = await self.client.proxy_state(wait_drained=min(remaining, 10.0))
            progress.drain(state.inflight)
        return inflight_at_pause, self.clock() - started
