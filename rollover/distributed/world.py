"""Where this process sits among the trainer ranks, read from torch's launcher environment."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Rank 0 may spend a long time in rollouts while the other ranks wait on its next command:
# the command channel's group waits this long (the training collectives: trainer.nccl_timeout).
COMMAND_TIMEOUT = datetime.timedelta(hours=6)


@dataclass(frozen=True)
class World:
    """Ranks of one run. The single-process run is `World()`: rank 0 of 1, no process group."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0 runs what exists once: gateway, controller, the window loop, metrics."""
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0 of each node owns that node's engines and writes its weights."""
        return self.local_rank == 0

    @property
    def n_nodes(self) -> int:
        return self.size // self.local_size

    @classmethod
    def from_env(cls) -> World:
        """The variables torchrun (torch.distributed.run) sets for every worker."""
        if "RANK" not in os.environ:
            return cls()
        size = int(os.environ["WORLD_SIZE"])
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        return cls(
            rank=int(os.environ["RANK"]),
            size=size,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            local_size=local_size,
            node_rank=int(os.environ.get("GROUP_RANK", int(os.environ["RANK"]) // local_size)),
        )

    def device(self, setting: str) -> torch.device:
        """This rank's device: `cuda:<local rank>` on GPU nodes."""
        if setting == "auto":
            setting = "cuda" if torch.cuda.is_available() else "cpu"
        if setting == "cuda" and self.distributed:
            return torch.device("cuda", self.local_rank)
        return torch.device(setting)

    def init_process_group(self, device: torch.device, *, timeout_s: float) -> None:
        """The training collectives' group: NCCL between GPUs, gloo on CPU, each collective
        failing after `timeout_s` (trainer.nccl_timeout); a no-op for one rank. Waiting on
        rank 0's commands has a group of its own (`CommandChannel`)."""
        if not self.distributed or dist.is_initialized():
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
