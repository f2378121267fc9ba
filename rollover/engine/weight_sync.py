"""Collocated weight sync: the trainer's `WeightSync` protocol carried out with this node's
running `VLLMEngine`s (gather the weights whole, save safetensors once, in files of at most
verl's `update_weights_bucket_megabytes`, every engine reloads them in place, in parallel).
With LoRA only the adapter moves (`EngineAdapterSync`): the engines keep their base weights and
load each version's adapter at runtime. Both write a version's folder, load it into every
engine under the engine's lock, and keep only the newest folder (`_EngineSync`)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rollover.engine.settings import EngineSettings
from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weights import save_weights


class GatherableActor(Protocol):
    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]: ...


class AdapterActor(Protocol):
    def save_adapter(self, directory: str | Path, *, write: bool) -> None: ...


class _EngineSync:
    """What both syncs share: write the version's folder under `root/v{version}` (a rank with no
    engines takes part in gathering, a collective on several ranks, and keeps nothing), load it
    into every engine in parallel, each under its lock (`locks[i]` is shared with engine i's
    watchdog, so a restart never races a load), then keep only that version's folder (an engine
    restarted by its watchdog loads it again)."""

    def __init__(self, engines: Sequence[VLLMEngine], root: Path, locks: Sequence[asyncio.Lock] | None = None) -> None:
        self.engines = list(engines)
        self.root = root
        self.locks = list(locks) if locks is not None else [asyncio.Lock() for _ in self.engines]

    async def before_update(self) -> None:
        """Give the GPU engines' KV cache memory to the update; the next load wakes each engine."""
        await asyncio.gather(*(engine.sleep(1) for engine in self.engines if engine.device == "cuda"))

    async def sync(self, actor: Any, version: int) -> None:
        target = self.root / f"v{version}"
        if not await self._write(actor, target):
            return
        await asyncio.gather(
            *(self._load_under(lock, engine, target, version) for engine, lock in zip(self.engines, self.locks))
        )
        for old in target.parent.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    async def _load_under(self, lock: asyncio.Lock, engine: VLLMEngine, target: Path, version: int) -> None:
        async with lock:
            await self._load(engine, target, version)

    async def _write(self, actor: Any, target: Path) -> bool:
        """Write `target` (every rank takes part); False on a rank with no engines."""
        raise NotImplementedError

    async def _load(self, engine: VLLMEngine, target: Path, version: int) -> None:
        raise NotImplementedError


class EngineWeightSync(_EngineSync):
    """The whole model: its weights gathered whole and saved once in safetensors files of at
    most `bucket_megabytes` MiB each (a tensor larger than that is a file of its own), reloaded
    in place by every engine."""

    def __init__(
        self,
        engines: Sequence[VLLMEngine],
        weights_root: Path,
        locks: Sequence[asyncio.Lock] | None = None,
        *,
        bucket_megabytes: int,
    ) -> None:
        super().__init__(engines, weights_root, locks)
        self.bucket_bytes = bucket_megabytes << 20  # MiB, as verl counts them

    async def _write(self, actor: GatherableActor, target: Path) -> bool:
        weights = await asyncio.to_thread(actor.full_state_dict, keep=bool(self.engines))
        if not self.engines:
            return False
        await asyncio.to_thread(save_weights, weights, target, max_shard_bytes=self.bucket_bytes)
        return True

    async def _load(self, engine: VLLMEngine, target: Path, version: int) -> None:
        await engine.load_weights(target, version=version)


class EngineAdapterSync(_EngineSync):
    """LoRA's weight sync: the policy's adapter alone (with several policies, a folder per
    policy), gathered and saved in PEFT's format under `adapters_root/v{version}`, and swapped
    into every engine at runtime under one stable name (`VLLMEngine.load_adapter`, which serves
    it from `adapters_root/served/<name>`). Only the current version's folder is kept (an engine
    restarted by its watchdog loads it again)."""

    def __init__(
        self, engines: Sequence[VLLMEngine], adapters_root: Path, locks: Sequence[asyncio.Lock] | None = None
    ) -> None:
        super().__init__(engines, adapters_root, locks)
        self.last_bytes = 0  # what the last sync wrote and the engines read

    async def _write(self, actor: AdapterActor, target: Path) -> bool:
        await asyncio.to_thread(actor.save_adapter, target, write=bool(self.engines))
        if not self.engines:
            return False
        self.last_bytes = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        return True

    async def _load(self, engine: VLLMEngine, target: Path, version: int) -> None:
        await engine.load_adapter(target, version=version)


def engine_weight_sync(
    settings: EngineSettings, engines: Sequence[VLLMEngine], root: Path, locks: Sequence[asyncio.Lock]
) -> EngineWeightSync | EngineAdapterSync:
    """The node's weight sync: the adapter alone with LoRA, else the whole model."""
    if settings.lora:
        return EngineAdapterSync(engines, root, locks)
    return EngineWeightSync(engines, root, locks, bucket_megabytes=settings.bucket_megabytes)
