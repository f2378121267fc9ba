"""One way to retry a call that can fail for a while: a gateway restarting, an engine still
busy, the Kubernetes API throttling. tenacity does the waiting (exponential, capped); each
call site says which errors are transient and how long to keep trying, and any other error
propagates at once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    stop_never,
    wait_exponential,
)
from tenacity.stop import stop_base

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry the errors `transient` accepts: wait `first_wait`, then twice as long each time
    up to `max_wait`; stop after `attempts` tries or once `give_up_after` seconds have passed
    (whichever comes first; neither = never), raising the last error as it was."""

    transient: Callable[[BaseException], bool]
    attempts: int | None = None
    give_up_after: float | None = None
    first_wait: float = 0.5
    max_wait: float = 10.0

    def retrying(self, what: str, logger: logging.Logger = log) -> AsyncRetrying:
        """`async for attempt in policy.retrying(...): with attempt: ...`"""
        stops: list[stop_base] = []
        if self.attempts is not None:
            stops.append(stop_after_attempt(self.attempts))
        if self.give_up_after is not None:
            stops.append(stop_after_delay(self.give_up_after))

        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            logger.warning("%s failed (retrying in %.1fs): %r", what, wait, error)

        return AsyncRetrying(
            stop=stop_any(*stops) if stops else stop_never,
            wait=wait_exponential(multiplier=self.first_wait, min=self.first_wait, max=self.max_wait),
            retry=retry_if_exception(self.transient),
            before_sleep=before_sleep,
            reraise=True,
        )


async def call_with_retries(
    what: str, call: Callable[[], Awaitable[T]], policy: RetryPolicy, logger: logging.Logger = log
) -> T:
    """`await call()` until it returns, as `policy` says; `what` names it in the log."""
    async for attempt in policy.retrying(what, logger):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity reraises the last error")
