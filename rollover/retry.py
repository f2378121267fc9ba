"""One way to retry a call that can fail for a while: a gateway restarting, an engine still
busy, the Kubernetes API throttling. tenacity does the waiting (exponential, capped); each
call site says which errors are transient and how long to keep trying, and any other error
propagates at once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
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


def retrying(
    what: str,
    *,
    transient: Callable[[BaseException], bool],
    attempts: int | None = None,
    give_up_after: float | None = None,
    first_wait: float = 0.5,
    max_wait: float = 10.0,
    logger: logging.Logger = log,
) -> AsyncRetrying:
    """`async for attempt in retrying(...): with attempt: ...`. Waits `first_wait`, then
    twice as long each time up to `max_wait`; stops after `attempts` tries or once
    `give_up_after` seconds have passed (whichever comes first; neither = never) and raises
    the last error as it was."""
    stops: list[stop_base] = []
    if attempts is not None:
        stops.append(stop_after_attempt(attempts))
    if give_up_after is not None:
        stops.append(stop_after_delay(give_up_after))

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("%s failed (retrying in %.1fs): %r", what, wait, error)

    return AsyncRetrying(
        stop=stop_any(*stops) if stops else stop_never,
        wait=wait_exponential(multiplier=first_wait, min=first_wait, max=max_wait),
        retry=retry_if_exception(transient),
        before_sleep=before_sleep,
        reraise=True,
    )


async def call_with_retries(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    transient: Callable[[BaseException], bool],
    attempts: int | None = None,
    give_up_after: float | None = None,
    first_wait: float = 0.5,
    max_wait: float = 10.0,
    logger: logging.Logger = log,
) -> T:
    """`await call()` until it returns, retrying the errors `transient` accepts (see `retrying`)."""
    policy = retrying(
        what,
        transient=transient,
        attempts=attempts,
        give_up_after=give_up_after,
        first_wait=first_wait,
        max_wait=max_wait,
        logger=logger,
    )
    async for attempt in policy:
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity reraises the last error")
