"""The device pool's config rules and the launcher environment, without starting ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollover.config import ConfigError, load_config
from rollover.distributed.world import World
from rollover.ranks.rank import check_world

CALC_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "calc" / "config.yaml"


def test_engines_per_node_is_devices_over_tensor_parallel_size():
    config = load_config(
        None,
        ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
    )
    assert config.world_size == 16 and config.engines_per_node == 4


def test_devices_not_divisible_by_tensor_parallel_size_names_both_keys():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    message = str(caught.value)
    assert "trainer.n_gpus_per_node=3" in message and "tensor_model_parallel_size=2" in message


def test_world_is_read_from_torchs_launcher(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert World.from_env() == World()  # no launcher: one rank, no process group
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }.items():
        monkeypatch.setenv(name, value)
    world = World.from_env()
    assert (world.rank, world.size, world.local_rank, world.node_rank, world.n_nodes) == (3, 4, 1, 1, 2)
    assert world.distributed and not world.is_leader and not world.is_node_leader


def test_a_launcher_that_disagrees_with_the_config_is_an_error_naming_the_keys():
    config = load_config(None, ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"])
    check_world(config, World(rank=0, size=2, local_size=2))
    with pytest.raises(ConfigError, match=r"trainer.nnodes=1 x trainer.n_gpus_per_node=2"):
        check_world(config, World(rank=0, size=4, local_size=2))


def test_rollover_train_over_several_nodes_says_how_to_launch_them(capsys):
    from rollover.cli.main import main

    assert main(["train", str(CALC_CONFIG), "trainer.nnodes=2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nnodes 2" in err and "-m rollover.ranks" in err


def test_a_rank_leaves_with_its_code_and_its_output_but_without_the_interpreters_teardown():
    """`exit_rank`: what was printed reaches the launcher, the code is the run's, and no
    teardown runs after it (where gloo's threads once aborted a finished rank)."""
    import os
    import subprocess
    import sys

    script = (
        "import atexit, sys\n"
        "from rollover.ranks.rank import exit_rank\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "print('run finished', end='')\n"
        "sys.stderr.write('last words')\n"
        "exit_rank(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as under a launcher
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3
    assert done.stdout == "run finished"  # flushed, and the atexit handler never ran
    assert done.stderr.endswith("last words")
