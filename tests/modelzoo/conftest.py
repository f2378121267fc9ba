from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollover.engine.testing import tiny_model_dir  # noqa: E402,F401
