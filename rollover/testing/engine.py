"""A small CPU vLLM engine for tests and benchmarks (the suite starts one per session, see
tests/conftest.py); a test that loads other weights into it loads the model back before it
ends (`restore_weights`), since later tests share the server."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from rollover.engine.vllm_engine import VLLMEngine
from rollover.processes import descendant_pids, pid_alive

TEST_MAX_MODEL_LEN = 512


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def start_test_engine(model_dir: str | Path, log_path: str | Path | None = None, **kwargs: object) -> VLLMEngine:
    """Start a small CPU engine in eager mode (fastest start) and wait until ready."""
    opts: dict[str, object] = dict(
        max_model_len=TEST_MAX_MODEL_LEN,
        kv_cache_space_gb=1,
        enforce_eager=True,
        start_timeout_s=240,
    )
    opts.update(kwargs)
    engine = VLLMEngine(model_dir, log_path=log_path, **opts)  # type: ignore[arg-type]
    engine.start()
    engine.wait_ready()
    return engine


def engine_family(engine: VLLMEngine) -> set[int]:
    """The engine's supervisor and all its descendants now."""
    if engine.pid is None:
        return set()
    return descendant_pids(engine.pid) | {engine.pid}


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if pid_alive(p)}


def restore_weights(engine: VLLMEngine, model_dir: str | Path) -> None:
    """Load the original weights back (keeps `policy_version` increasing)."""
    asyncio.run(engine.load_weights(model_dir))
