"""Keep an engine serving through a crash: restart it with the weights it last served.

Before the restart the engine is taken out of the gateway's rotation, so the rollouts it
served move to the live engines at once (the proxy would also find it out at its next call);
the restarted engine registers again, live, with its policy version. While no engine is live
the gateway answers agents with 503 (a JSON error with the reason), and the SDK's OpenAI
client retries 5xx with backoff, so agents wait out a restart instead of failing.

One watchdog per engine. Each takes its `lock` for the restart, and weight sync holds the
engines' locks for a reload, so a restart never races a reload: watchdogs may share one lock
(restarts then take turns) or have one each.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from rollover.engine.server import EngineError

log = logging.getLogger("rollover.engine")


class RestartableEngine(Protocol):
    """What the watchdog needs of an engine (`VLLMEngine` has it)."""

    policy_version: int

    @property
    def base_url(self) -> str: ...

    def failure(self) -> str | None: ...

    async def take_out_of_rotation(self) -> None: ...

    async def restart(self) -> float: ...


class EngineWatchdog:
    def __init__(
        self, engine: RestartableEngine, lock: asyncio.Lock, *, max_restarts: int, interval: float = 1.0
    ) -> None:
        self.engine = engine
        self.lock = lock
        self.max_restarts = max_restarts
        self.interval = interval
        self.restarts = 0

    async def check(self) -> bool:
        """Restart the engine if it died; True if it did. Raises `EngineError` once
        `max_restarts` restarts are used up (the crash then ends the run, with its reason)."""
        # Looked at without the lock, which a reload of every engine may hold for a while: a
        # dead engine leaves the rotation before that ends.
        if self.engine.failure() is None:
            return False
        await self.engine.take_out_of_rotation()
        async with self.lock:
            failure = self.engine.failure()
            if failure is None:
                return False
            if self.restarts >= self.max_restarts:
                raise EngineError(
                    f"the inference engine died again after {self.restarts} restart(s) "
                    f"(actor_rollout_ref.rollout.max_engine_restarts={self.max_restarts}): {failure}"
                )
            self.restarts += 1
            log.error(
                "the inference engine at %s died; restarting it (%d of %d): %s",
                self.engine.base_url,
                self.restarts,
                self.max_restarts,
                failure,
            )
            seconds = await self.engine.restart()
            log.warning(
                "the inference engine at %s is back after %.1f s, serving policy version %d",
                self.engine.base_url,
                seconds,
                self.engine.policy_version,
            )
            return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()
