"""The `trainer` section: the run's length, logging, checkpoints and ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from rollover.config.base import Section


class TrainerConfig(Section):
    setup_hook: str | None = Field(
        default=None, description='"pkg.module:function" run first; may build data and model (examples use it)'
    )
    project_name: str = Field(default="rollover", description="project name for the loggers")
    experiment_name: str = Field(
        default="run",
        min_length=1,
        description="experiment name for the loggers and the run folder (a folder name: no '/' and not '..')",
    )

    @field_validator("experiment_name")
    @classmethod
    def _one_folder_name(cls, value: str) -> str:
        # It names a folder under default_local_dir, which is renamed when a fresh run reuses it.
        if "/" in value or "\\" in value or "\0" in value or value in (".", ".."):
            raise ValueError(f"must be a single folder name (no '/', '\\' or NUL, not '.' or '..'), got {value!r}")
        return value

    default_local_dir: str = Field(default="runs", description="run folder = <default_local_dir>/<experiment_name>")
    total_training_steps: int | None = Field(
        default=10, gt=0, description="updates, then the run ends; null = total_epochs passes over the training tasks"
    )
    total_epochs: int | None = Field(
        default=None,
        gt=0,
        description="passes over the training tasks when total_training_steps is null (a file that sets only this one means it)",
    )
    logger: list[Literal["console", "jsonl", "wandb"]] = Field(
        default=["console", "jsonl"], description="console | jsonl | wandb"
    )
    save_freq: int = Field(
        default=0, ge=-1, description="checkpoint every N steps and at the end; 0 = only at the end; -1 = never"
    )
    test_freq: int = Field(
        default=0, ge=-1, description="held-out evaluation every N steps; 0 or -1 = only before and after training"
    )
    val_before_train: bool = Field(default=True, description="a held-out evaluation before the first update")
    critic_warmup: int = Field(default=0, ge=0, description="verl's critic warm-up steps (no critic here: GRPO/RLOO)")
    nccl_timeout: float = Field(
        default=600,
        gt=0,
        description="seconds a collective of the trainer ranks may wait (the process group's timeout)",
    )
    max_failed_steps: int = Field(
        default=3,
        ge=0,
        description="the run stops after this many steps in a row whose every rollout failed; 0 = never",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto | cpu | cuda")
    nnodes: int = Field(default=1, ge=1, description="nodes of the run (torchrun --nnodes)")
    n_gpus_per_node: int = Field(
        default=1, ge=1, description="trainer ranks per node (GPUs; on CPU, processes), each holding an FSDP2 shard"
    )
    seed: int = Field(default=0, description="seed of the update's mini-batch shuffling (and of a fresh LoRA adapter)")

    @property
    def run_dir(self) -> Path:
        return Path(self.default_local_dir) / self.experiment_name
