"""Train the ScienceWorld agent: `python examples/sw/train_sw_agent.py [--async] [key=value ...]`.

The config presets collocated asynchronous rollout with a window of 1.5 x train_batch_size
(ScienceWorld episodes are long-tailed); `--async` sets the recommended start instead,
async_train_batch_size = 2 * train_batch_size, computed from the (possibly overridden) batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# Agent processes import examples.sw.agent too, from wherever this is run.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

from rollover.config import ConfigError, load_config  # noqa: E402
from rollover.training.run import run_training  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--async", dest="use_async", action="store_true", help="async rollout, window = 2 x batch")
    parser.add_argument("--config", default=str(Path(__file__).with_name("config.yaml")))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:
        config = load_config(args.config, args.overrides)
        if args.use_async:
            config.agentlightning.async_rollout.enabled = True
            config.agentlightning.async_rollout.async_train_batch_size = config.data.train_batch_size * 2
        return run_training(config)
    except (ConfigError, ValueError) as exc:
        print(f"train_sw_agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
