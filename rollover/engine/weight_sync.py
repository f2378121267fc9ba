"""Collocated weight sync: the trainer's `WeightSync` protocol carried out with this node's
running `VLLMEngine`s (gather the weights whole, save safetensors once, in files of at most
verl's `update_weights_bucket_megabytes`, every engine reloads them in place, in parallel).
With LoRA only the adapter moves (`EngineAdapterSync`): the engines keep their base weights and
load each version's adapter at runtime."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from rollover.config import RolloverConfig
from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weights import save_weights


class GatherablePolicy(Protocol):
    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]: ...


class AdapterPolicy(Protocol):
    def save_adapter(self, directory: str | Path, *, write: bool) -> None: ...


class EngineWeightSync:
    """Save the policy's weights under `weights_root/v{version}`, in safetensors files of at
    most `bucket_megabytes` MiB each (a tensor larger than that is a file of its own), and
    reload them in every engine. `locks[i]` is shared with engine i's watchdog, so a restart
    never races a reload. A rank with no engines takes part in gathering the weights (a
    collective on several ranks) and keeps nothing."""

    def __init__(
        self,
        engines: Sequence[VLLMEngine],
        weights_root: Path,
        locks: Sequence[asyncio.Lock] | None = None,
        *,
        bucket_megabytes: int,
    ) -> None:
        self.engines = list(engines)
        self.weights_root = weights_root
        self.bucket_bytes = bucket_megabytes << 20  # MiB, as verl counts them
        self.locks = list(locks) if locks is not None else [asyncio.Lock() for _ in self.engines]

    async def before_update(self) -> None:
        await _sleep_gpu_engines(self.engines)

    async def sync(self, policy: GatherablePolicy, version: int) -> None:
        weights = await asyncio.to_thread(policy.full_state_dict, keep=bool(self.engines))
        if not self.engines:
            return
        target = self.weights_root / f"v{version}"
        await asyncio.to_thread(save_weights, weights, target, max_shard_bytes=self.bucket_bytes)
        del weights
        await asyncio.gather(
            *(self._reload(engine, lock, target, version) for engine, lock in zip(self.engines, self.locks))
        )
        _keep_only(target)

    @staticmethod
    async def _reload(engine: VLLMEngine, lock: asyncio.Lock, target: Path, version: int) -> None:
        async with lock:
            await engine.load_weights(target, version=version)


class EngineAdapterSync:
    """LoRA's weight sync: the policy's adapter alone (with several policies, a folder per
    policy), gathered and saved in PEFT's format under `adapters_root/v{version}`, and swapped
    into every engine at runtime under one stable name (`VLLMEngine.load_adapter`, which serves
    it from `adapters_root/served/<name>`). Only the current version's folder is kept (an engine
    restarted by its watchdog loads it again)."""

    def __init__(
        self, engines: Sequence[VLLMEngine], adapters_root: Path, locks: Sequence[asyncio.Lock] | None = None
    ) -> None:
        self.engines = list(engines)
        self.adapters_root = adapters_root
        self.locks = list(locks) if locks is not None else [asyncio.Lock() for _ in self.engines]
        self.last_bytes = 0  # what the last sync wrote and the engines read

    async def before_update(self) -> None:
        await _sleep_gpu_engines(self.engines)

    async def sync(self, policy: AdapterPolicy, version: int) -> None:
        target = self.adapters_root / f"v{version}"
        await asyncio.to_thread(policy.save_adapter, target, write=bool(self.engines))
        if not self.engines:
            return
        self.last_bytes = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        await asyncio.gather(
            *(self._load(engine, lock, target, version) for engine, lock in zip(self.engines, self.locks))
        )
        _keep_only(target)

    @staticmethod
    async def _load(engine: VLLMEngine, lock: asyncio.Lock, target: Path, version: int) -> None:
        async with lock:
            await engine.load_adapter(target, version=version)


def engine_weight_sync(
    config: RolloverConfig, engines: Sequence[VLLMEngine], root: Path, locks: Sequence[asyncio.Lock]
) -> EngineWeightSync | EngineAdapterSync:
    """The node's weight sync: the adapter alone with LoRA, else the whole model."""
    if config.actor_rollout_ref.model.lora:
        return EngineAdapterSync(engines, root, locks)
    bucket = config.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
    return EngineWeightSync(engines, root, locks, bucket_megabytes=bucket)


async def _sleep_gpu_engines(engines: Sequence[VLLMEngine]) -> None:
    """Give the GPU engines' KV cache memory to the update; the next load wakes each engine."""
    await asyncio.gather(*(engine.sleep(1) for engine in engines if engine.device == "cuda"))


def _keep_only(target: Path) -> None:
    """Remove the other versions' folders (`v*`) beside `target`: only the current one is kept."""
    for old in target.parent.glob("v*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
