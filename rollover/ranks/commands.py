"""Rank 0 drives the other ranks: every collective step of a run is a command it broadcasts
and then carries out itself, so all ranks enter each collective in the same order.

`Leader` is rank 0's side of it (`rollover.launch.Followers`); `LeaderActor` and
`LeaderWeightSync` are what rank 0's `Trainer` holds: the trainer's protocols, each call first
announced to the other ranks.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollover.distributed.world import COMMAND_TIMEOUT
from rollover.engine.weight_sync import EngineAdapterSync, EngineWeightSync
from rollover.training.actor import Actor
from rollover.training.plan import UpdatePlan
from rollover.training.samples import UpdateBatch


@dataclass
class Hello:
    """The run as rank 0 prepared it: what every rank loads and where the gateway is."""

    model_path: str
    run_dir: str
    gateway_url: str
    admin_key: str
    policy_version: int


@dataclass
class Update:
    plan: UpdatePlan


@dataclass
class BeforeUpdate:
    pass


@dataclass
class SyncWeights:
    version: int


@dataclass
class SaveModel:
    directory: str


@dataclass
class SaveTrainingState:
    directory: str


@dataclass
class LoadTrainingState:
    directory: str


@dataclass
class Stop:
    reason: str


Command = Hello | Update | BeforeUpdate | SyncWeights | SaveModel | SaveTrainingState | LoadTrainingState | Stop


class CommandChannel:
    """Broadcast from rank 0 over a gloo group of its own (objects are pickled by torch), which
    waits up to `COMMAND_TIMEOUT`: the other ranks wait here through rank 0's rollouts, which
    the training collectives' timeout (trainer.nccl_timeout) is not meant to cover.

    Every rank builds its channel at the same point, before any other group (a collective)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)

    def send(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> Command:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank with the channel's patience: for the engines of all nodes to
        start or reload, which no training collective covers."""
        dist.barrier(group=self.group)


class LeaderActor:
    """Rank 0's `ActorLike`: announces each collective, then takes part in it."""

    def __init__(self, local: Actor, channel: CommandChannel) -> None:
        self.local = local
        self.channel = channel
        self.tokenizer = local.tokenizer
        self.optimizer = local.optimizer

    @property
    def progress(self) -> Any:
        return self.local.progress

    @progress.setter
    def progress(self, value: Any) -> None:
        self.local.progress = value

    def update(self, batch: UpdateBatch, rng: random.Random, *, lr: float, kl_coef: float = 0.0) -> dict[str, float]:
        plan = self.local.plan(batch, rng, lr=lr, kl_coef=kl_coef)
        self.channel.send(Update(plan))
        return self.local.run_update(plan)

    def save(self, directory: str | Path) -> Path:
        self.channel.send(SaveModel(str(directory)))
        return self.local.save(directory)

    def save_training_state(self, directory: str | Path) -> None:
        self.channel.send(SaveTrainingState(str(directory)))
        self.local.save_training_state(directory)

    def load_training_state(self, directory: str | Path) -> None:
        self.channel.send(LoadTrainingState(str(directory)))
        self.local.load_training_state(directory)

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]:
        return self.local.full_state_dict(keep=keep)

    def save_adapter(self, directory: str | Path, *, write: bool) -> None:
        self.local.save_adapter(directory, write=write)  # gathering is announced by SyncWeights


class LeaderWeightSync:
    """Rank 0's `WeightSync`: every node's leader reloads its own engines from the weights
    it assembled; rank 0 returns once all of them have (a barrier)."""

    def __init__(self, local: EngineWeightSync | EngineAdapterSync, channel: CommandChannel) -> None:
        self.local = local
        self.channel = channel

    async def before_update(self) -> None:
        self.channel.send(BeforeUpdate())
        await self.local.before_update()

    async def sync(self, actor: LeaderActor, version: int) -> None:
        self.channel.send(SyncWeights(version))
        await self.local.sync(actor, version)  # gathering the weights is announced by SyncWeights
        await asyncio.to_thread(self.channel.barrier)


class Leader:
    """Rank 0 driving the other ranks over `channel` (`rollover.launch.Followers`)."""

    def __init__(self, channel: CommandChannel) -> None:
        self.channel = channel

    def hello(self, model_path: str, run_dir: str, gateway_url: str, admin_key: str, policy_version: int) -> None:
        self.channel.send(Hello(model_path, run_dir, gateway_url, admin_key, policy_version))

    def lead(self, actor: Actor, weight_sync: EngineWeightSync | EngineAdapterSync) -> tuple[Any, Any]:
        return LeaderActor(actor, self.channel), LeaderWeightSync(weight_sync, self.channel)

    def barrier(self) -> None:
        self.channel.barrier()

    def stop(self, reason: str) -> None:
        self.channel.send(Stop(reason))
