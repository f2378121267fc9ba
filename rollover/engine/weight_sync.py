"""Collocated weight sync: the trainer's `WeightSync` protocol carried out with a running
`VLLMEngine` (save safetensors, reload them in place)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weights import save_weights


class EngineWeightSync:
    """Save the policy's weights under `weights_root/v{version}` and reload them in the engine.
    `lock` is shared with the engine watchdog, so a restart never races a reload."""

    def __init__(self, engine: VLLMEngine, weights_root: Path, lock: asyncio.Lock | None = None) -> None:
        self.engine = engine
        self.weights_root = weights_root
        self.lock = lock or asyncio.Lock()

    async def before_update(self) -> None:
        if self.engine.device == "cuda":
            await self.engine.sleep(1)  # give the KV cache's memory to the update

    async def sync(self, policy: Any, version: int) -> None:
        target = self.weights_root / f"v{version}"
        await asyncio.to_thread(save_weights, policy.model, target)
        async with self.lock:
            await self.engine.load_weights(target, version=version)
        for old in self.weights_root.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
