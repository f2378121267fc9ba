"""The `data` section: tasks, batch sizes and token budgets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollover.config.base import Section

Truncation = Literal["error", "left", "right"]


class DataConfig(Section):
    train_files: str | None = Field(default=None, description="JSONL, one task input (JSON object) per line")
    val_files: str | None = Field(
        default=None, description="JSONL of held-out tasks, evaluated before and after training"
    )
    train_batch_size: int = Field(default=32, gt=0, description="completed prompt groups consumed by one update")
    val_batch_size: int = Field(default=32, gt=0, description="prompts in a held-out evaluation")
    max_prompt_length: int = Field(
        default=512, gt=0, description="token budget of a prompt; a sample longer than both budgets is truncated"
    )
    max_response_length: int = Field(
        default=256, gt=0, description="token budget of a response (see max_prompt_length)"
    )
    truncation: Truncation = Field(
        default="right",
        description="a sample over its token budget: right = later tokens cut, left = earliest context cut, error = not trained (counted in training/n_overlong_samples)",
    )
    seed: int = Field(default=0, description="seed of the prompt order")
    filter_overlong_prompts: bool = Field(
        default=False, description="verl's key: prompts come from running agents here, see truncation"
    )
