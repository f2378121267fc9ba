"""Every rank but 0: hold a shard, take part in each command rank 0 broadcasts, and on the
local rank 0 of other nodes, run that node's engines (started, registered with the gateway,
reloaded after each update, restarted by their watchdogs)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rollover.config import RolloverConfig
from rollover.distributed.world import World
from rollover.engine.pool import node_engines, register_all, wait_all_ready
from rollover.engine.settings import EngineSettings
from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.watchdog import EngineWatchdog
from rollover.engine.weight_sync import engine_weight_sync
from rollover.ranks.commands import (
    BeforeUpdate,
    CommandChannel,
    Hello,
    LoadTrainingState,
    SaveModel,
    SaveTrainingState,
    Stop,
    SyncWeights,
    Update,
)
from rollover.training.actor import Actor
from rollover.training.update_settings import ActorSettings

log = logging.getLogger("rollover.ranks")
T = TypeVar("T")


class NodeLoop:
    """An event loop on a thread of its own for the node's engines (their watchdogs run
    there while the main thread waits on rank 0's next command)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollover-node-engines", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def follow(config: RolloverConfig, world: World) -> int:
    channel = CommandChannel()
    hello = channel.receive()
    if isinstance(hello, Stop):
        return 0
    assert isinstance(hello, Hello), f"expected Hello first, got {hello!r}"
    run_dir = Path(hello.run_dir)
    engine_settings = EngineSettings.from_config(config)
    owns_engines = world.is_node_leader and world.node_rank > 0  # node 0's are rank 0's
    engines: list[VLLMEngine] = node_engines(engine_settings, hello.model_path, run_dir, world) if owns_engines else []
    node = NodeLoop()
    locks = [asyncio.Lock() for _ in engines]  # shared by each engine's watchdog and the weight sync
    watchdogs: list[concurrent.futures.Future[None]] = []
    try:
        for engine in engines:
            engine.start()
        actor = Actor.load(hello.model_path, ActorSettings.from_config(config), world)
        if engines:
            node.run(wait_all_ready(engines))
            node.run(register_all(engines, hello.gateway_url, hello.admin_key, hello.policy_version))
            for engine, lock in zip(engines, locks):
                watchdog = EngineWatchdog(engine, lock, max_restarts=engine_settings.max_restarts)
                watchdogs.append(asyncio.run_coroutine_threadsafe(watchdog.run(), node.loop))
        channel.barrier()  # every node's engines serve: rank 0 starts rollouts
        weight_sync = engine_weight_sync(
            engine_settings, engines, run_dir / "weights" / f"node{world.node_rank}", locks
        )
        while True:
            _raise_if_an_engine_is_lost(watchdogs)
            command = channel.receive()
            if isinstance(command, Stop):
                return 0
            if isinstance(command, Update):
                actor.run_update(command.plan)
            elif isinstance(command, BeforeUpdate):
                node.run(weight_sync.before_update())
            elif isinstance(command, SyncWeights):
                node.run(weight_sync.sync(actor, command.version))
                channel.barrier()
            elif isinstance(command, SaveModel):
                actor.save(command.directory)
            elif isinstance(command, SaveTrainingState):
                actor.save_training_state(command.directory)
            elif isinstance(command, LoadTrainingState):
                actor.load_training_state(command.directory)
            else:
                raise RuntimeError(f"rank {world.rank}: unknown command {command!r}")
    finally:
        for engine in engines:
            engine.stop()
        node.close()


def _raise_if_an_engine_is_lost(watchdogs: list[concurrent.futures.Future[None]]) -> None:
    """A watchdog ends only by raising (restarts used up): the run stops, naming the engine,
    rather than this node training on with an engine that no longer serves."""
    for watchdog in watchdogs:
        failure = watchdog.exception() if watchdog.done() and not watchdog.cancelled() else None
        if failure is not None:
            raise failure
