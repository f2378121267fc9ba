"""One trainer rank with LoRA on, started by torch's launcher (see `update_worker`):

    python -m torch.distributed.run --standalone --nproc-per-node N lora_worker.py \\
        MODEL_DIR WORK_DIR ACTION [CHECKPOINT]

ACTION `update`: one update on WORK_DIR/samples.pkl, then the sharded training state
(WORK_DIR/state) and the adapter as the engines get it (WORK_DIR/adapter, rank 0 writing).
ACTION `roles`: `update` with two policies (`planner` trains groups g0 and g2, `solver` g1).
ACTION `load`: load CHECKPOINT's training state. Both end with the whole model's weights
(WORK_DIR/weights.pt) and the optimizer's first moments (WORK_DIR/exp_avg.pt) from rank 0.
"""

from __future__ import annotations

import pickle
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch

from rollover.config import load_config
from rollover.distributed.world import World
from rollover.training.actor import Actor
from rollover.training.update_settings import ActorSettings
from tests.distributed.update_worker import OVERRIDES, first_moments

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
ROLES = ["agentlightning.policies={planner: {}, solver: {lr: 5e-3}}", "actor_rollout_ref.rollout.max_loras=2"]


def main(model_dir: str, work_dir: str, action: str, checkpoint: str | None = None) -> None:
    world = World.from_env()
    world.init_process_group(torch.device("cpu"), timeout_s=600)
    work = Path(work_dir)
    policy = Actor.load(
        model_dir,
        ActorSettings.from_config(load_config(None, [*OVERRIDES, *LORA, *(ROLES if action == "roles" else [])])),
        world,
    )
    if action in ("update", "roles"):
        batch, seed = pickle.loads((work / "samples.pkl").read_bytes())
        if action == "roles":
            batch.samples = [replace(s, policy="solver" if s.group_id == "g1" else "planner") for s in batch.samples]
        policy.run_update(policy.plan(batch, random.Random(seed), lr=1e-2))
        policy.save_training_state(work / "state")
        policy.save_adapter(work / "adapter", write=world.is_leader)
    else:
        assert checkpoint is not None
        policy.load_training_state(checkpoint)
    moments = first_moments(policy)
    weights = policy.full_state_dict(keep=world.is_leader)
    if world.is_leader:
        torch.save(weights, work / "weights.pt")
        torch.save(moments, work / "exp_avg.pt")
    world.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
