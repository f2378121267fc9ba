"""The one retry helper: transient errors are retried, others propagate at once, and it
gives up with the last error as it was."""

from __future__ import annotations

import pytest

from rollover.retry import RetryPolicy, call_with_retries


class Transient(Exception):
    pass


class Fatal(Exception):
    pass


def failing(errors: list[Exception]):
    calls: list[int] = []

    async def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    return call, calls


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, Transient)


async def test_transient_errors_are_retried_until_the_call_succeeds():
    call, calls = failing([Transient("a"), Transient("b")])
    assert (
        await call_with_retries("x", call, RetryPolicy(transient=is_transient, attempts=5, first_wait=0.001)) == "done"
    )
    assert len(calls) == 3


async def test_other_errors_propagate_at_once():
    call, calls = failing([Fatal("no"), Transient("a")])
    with pytest.raises(Fatal):
        await call_with_retries("x", call, RetryPolicy(transient=is_transient, attempts=5, first_wait=0.001))
    assert len(calls) == 1


async def test_gives_up_after_the_attempts_with_the_last_error():
    call, calls = failing([Transient(str(i)) for i in range(10)])
    with pytest.raises(Transient, match="^2$"):
        await call_with_retries("x", call, RetryPolicy(transient=is_transient, attempts=3, first_wait=0.001))
    assert len(calls) == 3


async def test_gives_up_after_the_time_budget(caplog):
    call, calls = failing([Transient(str(i)) for i in range(1000)])
    with pytest.raises(Transient):
        await call_with_retries(
            "the thing", call, RetryPolicy(transient=is_transient, give_up_after=0.05, first_wait=0.01)
        )
    assert 1 < len(calls) < 1000
    assert "the thing failed (retrying in" in caplog.text
