"""Test helpers: a tiny model and one shared vLLM server per test session.

Import the fixtures into a conftest.py to use them:

    from rollover.engine.testing import tiny_model_dir, vllm_engine  # noqa: F401

`vllm_engine` serves `tiny_model_dir` under the name "policy"; a test that loads other
weights into it must load `tiny_model_dir` back before it ends (`restore_weights`), since
later tests share the server. Tests that need it are skipped when vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from rollover.engine.vllm_engine import VLLMEngine
from rollover.processes import descendant_pids, pid_alive

TEST_MAX_MODEL_LEN = 512


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_test_model(out_dir: str | Path) -> Path:
    """The tiny model every engine test uses (qwen2, 2 layers, width 128, ~1k vocab)."""
    from rollover.modelzoo.tiny import build_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return build_tiny_model(out_dir)


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


try:
    import pytest
except ImportError:  # pragma: no cover - only test code imports this module
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return build_test_model(tmp_path_factory.mktemp("tiny-model") / "model")

    @pytest.fixture(scope="session")
    def vllm_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngine]:
        if not vllm_available():
            pytest.skip("vLLM is not installed")
        log_path = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
        engine = start_test_engine(tiny_model_dir, log_path=log_path)
        try:
            yield engine
        finally:
            family = engine_family(engine)
            engine.stop()
            left = alive(family)
            # A leak here would outlive the test run; fail loudly.
            assert not left, f"vLLM processes left after stop(): {sorted(left)}"


def restore_weights(engine: VLLMEngine, model_dir: str | Path) -> None:
    """Load the original weights back (keeps `policy_version` increasing)."""
    engine.load_weights_sync(model_dir)
