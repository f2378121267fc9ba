"""A seeded request whose prefill is split survives on CPU: vLLM's rewind of its generator
(an offset only CUDA's generators have) is skipped there, and nothing else changes."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch

from rollover.engine import cpu_seeds


class FakeRunner:
    """The part of vLLM's runner the patch touches, rewinding as vLLM 0.32 does."""

    def __init__(self, generators: dict[int, torch.Generator], discard: list[bool]) -> None:
        self.input_batch = types.SimpleNamespace(generators=generators, num_reqs=len(discard))
        self.discard_request_mask = types.SimpleNamespace(np=np.array(discard + [False] * 4))
        self.seen: dict[int, torch.Generator] = {}

    def _bookkeeping_sync(self, *args: Any) -> str:
        self.seen = dict(self.input_batch.generators)
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "done"


def fake_module() -> types.ModuleType:
    module = types.ModuleType("fake_runner")
    module.GPUModelRunner = type("GPUModelRunner", (FakeRunner,), {})  # type: ignore[attr-defined]
    return module


def test_vllms_rewind_fails_on_a_cpu_generator_and_the_patch_skips_it() -> None:
    module = fake_module()
    generators = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
    with pytest.raises(RuntimeError, match="does not use offset"):
        module.GPUModelRunner(dict(generators), [True, False, True])._bookkeeping_sync()
    cpu_seeds.patch(module)
    cpu_seeds.patch(module)  # idempotent
    runner = module.GPUModelRunner(dict(generators), [True, False, False])
    assert runner._bookkeeping_sync() == "done"
    assert set(runner.seen) == {2}  # the discarded request's generator was held out of the rewind
    assert runner.input_batch.generators == generators  # and put back


def test_only_cpu_generators_of_discarded_requests_are_held() -> None:
    cpu = torch.Generator()
    other = types.SimpleNamespace(device=torch.device("meta"))  # stands in for a CUDA generator
    generators: dict[int, Any] = {0: cpu, 1: other, 3: torch.Generator()}
    held = cpu_seeds.hold_cpu_generators(generators, [0, 1, 2])
    assert held == {0: cpu} and set(generators) == {1, 3}


@pytest.mark.vllm
@pytest.mark.slow
def test_a_seeded_request_with_a_split_prefill_keeps_the_engine_alive(calc_model, tmp_path) -> None:
    from rollover.testing.engine import start_test_engine
    from tests.engine.test_token_fidelity import sample

    # A prompt longer than one step's token budget is prefilled in chunks, and the token
    # sampled after each unfinished chunk is dropped: the rewind that killed the engine on CPU.
    engine = start_test_engine(
        calc_model, log_path=tmp_path / "vllm.log", extra_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "4"]
    )
    try:
        prompt = "Compute " + " plus ".join(str(n) for n in range(40)) + "."
        for seed in (1, 1, 2):
            assert sample(engine, prompt, seed)["usage"]["prompt_tokens"] > 32
        with engine.client(120) as http:
            assert http.get("/health").status_code == 200
    finally:
        engine.stop()
