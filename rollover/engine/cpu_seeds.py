"""Seeded requests survive a split prefill on CPU (installed in every vLLM process by
`rollover.engine.vllm_plugin`).

vLLM 0.32 samples a token for every scheduled request, then drops the token of each request
whose prompt is not yet all prefilled (a chunked prefill; a multimodal prompt scheduled up to
its image while the encoder's budget is spent) and rewinds that request's seeded generator by
4 offsets (`GPUModelRunner._bookkeeping_sync`). Only CUDA's Philox generators have an offset:
on CPU `get_offset` raises "CPU Generator does not use offset", the engine core dies and every
request in flight fails. Measured here: the vision calc example's held-out evaluation (128
seeded requests, each with a picture) killed the engine four times in a row.

Here the rewind is skipped for CPU generators: a seeded request whose prefill was split draws
once more from its stream than one whose prefill was not, so the same request with the same
schedule still samples the same tokens, but not across schedules. CUDA is untouched. The runner
module is patched when it is first imported (vLLM imports it in the engine's worker only:
importing it in every process would cost seconds).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_MARK = "_rollover_cpu_seeds"


def hold_cpu_generators(generators: dict[int, torch.Generator], discarded: Sequence[int]) -> dict[int, torch.Generator]:
    """Take out of `generators` (by request index) the CPU generators of the `discarded`
    requests, which vLLM would rewind; the caller puts them back."""
    held = {}
    for index in discarded:
        generator = generators.get(int(index))
        if generator is not None and generator.device.type == "cpu":
            held[int(index)] = generators.pop(int(index))
    return held


def patch(module: ModuleType) -> None:
    """Wrap the runner's `_bookkeeping_sync` so it never rewinds a CPU generator (idempotent)."""
    runner = module.GPUModelRunner
    original = runner._bookkeeping_sync
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def bookkeeping(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = self.discard_request_mask.np[: self.input_batch.num_reqs]
        held = hold_cpu_generators(self.input_batch.generators, mask.nonzero()[0].tolist())
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    setattr(bookkeeping, _MARK, True)
    runner._bookkeeping_sync = bookkeeping


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the runner module as Python would, and patches it right after it runs."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != RUNNER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch the runner now if it is imported, else when it is."""
    if RUNNER_MODULE in sys.modules:
        patch(sys.modules[RUNNER_MODULE])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
