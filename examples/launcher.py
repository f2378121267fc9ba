"""The command line shared by the examples' `train_*_agent.py` scripts:
`[--async] [--config C] [key=value ...]`, where `--async` sets the seed's recommended
window, async_train_batch_size = 2 * train_batch_size."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rollover.cli.logs import configure_logging
from rollover.config import ConfigError, load_config
from rollover.launch import run_training

ROOT = Path(__file__).resolve().parents[1]


def example_main(config_path: str | Path, description: str | None = None, argv: list[str] | None = None) -> int:
    # Agent processes import `examples.*` too, from wherever the script is run (this process
    # found them through the script's own sys.path entry).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--async", dest="use_async", action="store_true", help="async rollout, window = 2 x batch")
    parser.add_argument("--config", default=str(config_path))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.use_async:
            config.agentlightning.async_rollout.enabled = True
            config.agentlightning.async_rollout.async_train_batch_size = 2 * config.data.train_batch_size
        configure_logging()
        return run_training(config)
    except (ConfigError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
