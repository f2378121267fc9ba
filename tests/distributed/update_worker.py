"""One trainer rank for the tests in this folder, started by torch's launcher:

    python -m torch.distributed.run --standalone --nproc-per-node N update_worker.py \\
        MODEL_DIR WORK_DIR ACTION [CHECKPOINT]

ACTION `update`: one update on the samples in WORK_DIR/samples.pkl, then the weights
(WORK_DIR/weights.pt, from rank 0) and the sharded training state (WORK_DIR/state).
ACTION `load`: load CHECKPOINT's training state, then the weights and the optimizer's first
moments (WORK_DIR/weights.pt, WORK_DIR/exp_avg.pt).
ACTION `modes`: for each `(name, overrides)` of WORK_DIR/modes.json, a fresh policy with those
overrides takes the update; its weights and metrics go to WORK_DIR/NAME.pt and NAME.pkl.
"""

from __future__ import annotations

import json
import pickle
import random
import sys
from pathlib import Path

import torch

from rollover.config import load_config
from rollover.distributed.sharding import full_tensor
from rollover.distributed.world import World
from rollover.training.actor import Actor
from rollover.training.update_settings import ActorSettings

OVERRIDES = [
    "trainer.device=cpu",
    "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",  # the token-mean; per_rollout_mean is a mode
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.ppo_micro_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # prompts: 2 x rollout.n=2 samples per step
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "algorithm.rollout_correction.rollout_is=token",
]


def first_moments(policy: Actor) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in policy.model.named_parameters()}
    return {
        names[id(p)]: full_tensor(state["exp_avg"]).detach().cpu()
        for p, state in policy.optimizer.state.items()
        if "exp_avg" in state
    }


def main(model_dir: str, work_dir: str, action: str, checkpoint: str | None = None) -> None:
    world = World.from_env()
    world.init_process_group(torch.device("cpu"), timeout_s=600)
    work = Path(work_dir)
    if action == "modes":
        policy_modes(model_dir, work, world)
        world.shutdown()
        return
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, OVERRIDES)), world)
    if action == "update":
        batch, seed = pickle.loads((work / "samples.pkl").read_bytes())
        metrics = policy.run_update(policy.plan(batch, random.Random(seed), lr=1e-3))
        policy.save_training_state(work / "state")
        if world.is_leader:
            (work / "metrics.pkl").write_bytes(pickle.dumps(metrics))
    elif action == "load":
        assert checkpoint is not None
        policy.load_training_state(checkpoint)
        moments = first_moments(policy)
        if world.is_leader:
            torch.save(moments, work / "exp_avg.pt")
    weights = policy.full_state_dict(keep=world.is_leader)
    if world.is_leader:
        torch.save(weights, work / "weights.pt")
    world.shutdown()


def policy_modes(model_dir: str, work: Path, world: World) -> None:
    batch, seed = pickle.loads((work / "samples.pkl").read_bytes())
    for name, overrides in json.loads((work / "modes.json").read_text()):
        policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*OVERRIDES, *overrides])), world)
        metrics = policy.run_update(policy.plan(batch, random.Random(seed), lr=1e-3, kl_coef=0.05))
        weights = policy.full_state_dict(keep=world.is_leader)
        if world.is_leader:
            torch.save(weights, work / f"{name}.pt")
            (work / f"{name}.pkl").write_bytes(pickle.dumps(metrics))


if __name__ == "__main__":
    main(*sys.argv[1:])
