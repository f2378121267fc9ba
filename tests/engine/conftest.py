"""Engine tests share one tiny model and one vLLM server for the whole session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollover.engine.testing import tiny_model_dir, vllm_engine  # noqa: E402,F401
