"""Keep the engine serving through a crash: restart it with the weights it last served.

While vLLM is down the gateway answers agents with 503 (a JSON error with the reason), and
the SDK's OpenAI client retries 5xx with backoff, so agents wait out a restart instead of
failing. Weight sync and the watchdog share one lock, so a restart never races a reload.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollover.engine.vllm_engine import EngineError

log = logging.getLogger("rollover.engine")


class EngineWatchdog:
    def __init__(self, engine: Any, lock: asyncio.Lock, *, max_restarts: int, interval: float = 1.0) -> None:
        self.engine = engine
        self.lock = lock
        self.max_restarts = max_restarts
        self.interval = interval
        self.restarts = 0

    async def check(self) -> bool:
        """Restart the engine if it died; True if it did. Raises `EngineError` once
        `max_restarts` restarts are used up (the crash then ends the run, with its reason)."""
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
                "the inference engine died; restarting it (%d of %d): %s", self.restarts, self.max_restarts, failure
            )
            seconds = await self.engine.restart()
            log.warning(
                "the inference engine is back after %.1f s, serving policy version %d",
                seconds,
                self.engine.policy_version,
            )
            return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()
