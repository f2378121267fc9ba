"""One trainer rank, as torch's launcher starts it:

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m rollover.distributed CONFIG [key=value ...]

Rank 0 runs the whole system (`rollover.launch`); the others follow its commands.
"""

from __future__ import annotations

import sys

from rollover.cli.logs import configure_logging
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
    world = World.from_env()
    try:
        config = load_config(config_path, overrides)
        check_world(config, world)
    except (ConfigError, ValueError) as exc:
        print(f"rollover (rank {world.rank}): {exc}", file=sys.stderr)
        return 2
    configure_logging()
    device = world.device(config.trainer.device)
    world.init_process_group(device, timeout_s=config.trainer.nccl_timeout)
    try:
        if world.is_leader:
            from rollover.launch import run_training_reporting_errors

            try:
                return run_training_reporting_errors(config, world)
            except (ConfigError, ValueError) as exc:
                print(f"rollover train: {exc}", file=sys.stderr)
                return 2
        from rollover.distributed.follower import follow

        return follow(config, world)
    finally:
        world.shutdown()


if __name__ == "__main__":
    sys.exit(main())
