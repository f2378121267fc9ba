"""Collocated weight sync: the trainer's `WeightSync` protocol carried out with this node's
running `VLLMEngine`s (gather the weights whole, save safetensors once, every engine reloads
them in place, in parallel)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weights import save_weights


class GatherablePolicy(Protocol):
    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor]: ...


class EngineWeightSync:
    """Save the policy's weights under `weights_root/v{version}` and reload them in every
    engine. `locks[i]` is shared with engine i's watchdog, so a restart never races a reload.
    A rank with no engines takes part in gathering the weights (a collective on several
    ranks) and keeps nothing."""

    def __init__(
        self,
        engines: Sequence[VLLMEngine],
        weights_root: Path,
        locks: Sequence[asyncio.Lock] | None = None,
    ) -> None:
        self.engines = list(engines)
        self.weights_root = weights_root
        self.locks = list(locks) if locks is not None else [asyncio.Lock() for _ in self.engines]

    async def before_update(self) -> None:
        # Give the KV cache's memory to the update; load_weights wakes the engine.
        await asyncio.gather(*(engine.sleep(1) for engine in self.engines if engine.device == "cuda"))

    async def sync(self, policy: GatherablePolicy, version: int) -> None:
        weights = await asyncio.to_thread(policy.full_state_dict, keep=bool(self.engines))
        if not self.engines:
            return
        target = self.weights_root / f"v{version}"
        await asyncio.to_thread(save_weights, weights, target)
        del weights
        await asyncio.gather(
            *(self._reload(engine, lock, target, version) for engine, lock in zip(self.engines, self.locks))
        )
        for old in self.weights_root.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    async def _reload(engine: VLLMEngine, lock: asyncio.Lock, target: Path, version: int) -> None:
        async with lock:
            await engine.load_weights(target, version=version)
