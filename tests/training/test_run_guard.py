"""`rollover train` runs the trainer with the engine watchdog beside it: either ending ends both."""

import asyncio

import pytest

from rollover.engine.server import EngineError
from rollover.engine.watchdog import EngineWatchdog
from rollover.launch import _until_first_done


class DeadEngine:
    """An engine that died and comes back when restarted (as `VLLMEngine.restart` does)."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.restarted = 0
        self.policy_version = 3
        self.base_url = "http://127.0.0.1:1/v1"

    def failure(self):
        return "vLLM exited with code -9" if self.restarted < self.deaths else None

    async def take_out_of_rotation(self) -> None:
        pass

    async def restart(self) -> float:
        self.restarted += 1
        return 0.0


async def test_the_trainer_finishing_stops_the_watchdog():
    engine = DeadEngine(deaths=0)
    watchdog = EngineWatchdog(engine, asyncio.Lock(), max_restarts=1, interval=0.01)

    async def fit():
        await asyncio.sleep(0.05)
        return "history"

    assert await _until_first_done(fit(), watchdog.run()) == "history"
    assert watchdog.restarts == 0


async def test_a_restart_keeps_the_trainer_going_and_a_crash_too_many_stops_it():
    engine = DeadEngine(deaths=1)
    watchdog = EngineWatchdog(engine, asyncio.Lock(), max_restarts=1, interval=0.01)

    async def fit():
        await asyncio.sleep(0.1)
        return "history"

    assert await _until_first_done(fit(), watchdog.run()) == "history"
    assert engine.restarted == 1 and watchdog.restarts == 1

    engine.deaths = 5  # dies again: out of restarts
    cancelled = asyncio.Event()

    async def long_fit():
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    with pytest.raises(EngineError, match="max_engine_restarts=1"):
        await _until_first_done(long_fit(), watchdog.run())
    assert cancelled.is_set()  # the trainer was stopped, not left running
