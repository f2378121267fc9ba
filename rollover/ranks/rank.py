"""One trainer rank of a run on several (`python -m rollover.ranks`, or `rollover train` under
torch's launcher): rank 0 runs the whole system (`rollover.launch`) and announces each
collective step; the others follow its commands (`follower`). The caller configures logging.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from typing import NoReturn

from rollover.config import ConfigError, RolloverConfig, load_config
from rollover.distributed.world import World


def check_world(config: RolloverConfig, world: World) -> None:
    """The launcher's ranks are the ones the config asks for."""
    trainer = config.trainer
    if world.size != config.world_size or world.local_size != trainer.n_gpus_per_node:
        raise ConfigError(
            f"the launcher started {world.size} rank(s), {world.local_size} per node, but the config asks for "
            f"trainer.nnodes={trainer.nnodes} x trainer.n_gpus_per_node={trainer.n_gpus_per_node}; "
            "make torchrun's --nnodes and --nproc-per-node match them"
        )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config_path = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if config_path is not None else args
    faulthandler.enable()  # a rank that dies of a signal prints every thread's Python stack
    world = World.from_env()
    try:
        config = load_config(config_path, overrides)
        check_world(config, world)
    except (ConfigError, ValueError) as exc:
        print(f"rollover (rank {world.rank}): {exc}", file=sys.stderr)
        return 2
    device = world.device(config.trainer.device)
    world.init_process_group(device, timeout_s=config.trainer.nccl_timeout)
    try:
        if world.is_leader:
            from rollover.launch import run_training_reporting_errors
            from rollover.ranks.commands import CommandChannel, Leader

            # Built first on every rank, before any other group: a collective.
            followers = Leader(CommandChannel())
            try:
                return run_training_reporting_errors(config, world, followers)
            except (ConfigError, ValueError) as exc:
                print(f"rollover train: {exc}", file=sys.stderr)
                return 2
        from rollover.ranks.follower import follow

        return follow(config, world)
    finally:
        world.shutdown()


def exit_rank(code: int) -> NoReturn:
    """Leave a rank's process with `code` once `main` has returned (its process groups
    destroyed, its engines, gateway and loggers closed), skipping the interpreter's teardown:
    there gloo's threads may still hold tensors and abort a process whose run succeeded
    (SIGABRT, "terminate called without an active exception", seen once on a two-node run's
    rank 0; pytorch/pytorch#179291), and the other node's launcher then waits minutes for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
