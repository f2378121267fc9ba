"""A trainer checkpoint's folder: `checkpoints/step_N/` holds the model as engines and users load
it (`model/`), the sharded model and optimizer (`training_state/`, any number of ranks) and the
loop's own state (`trainer_state.json`: step, policy version, data position, carry-over, rng,
KL coefficient). A checkpoint exists only once it is complete; `checkpoints/latest` names it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

TRAINING_STATE = "training_state"  # a checkpoint's sharded model and optimizer (torch.distributed.checkpoint)


class Checkpointable(Protocol):
    def save(self, directory: str | Path) -> Path: ...

    def save_training_state(self, directory: str | Path) -> None: ...


def save_checkpoint(run_dir: Path, step: int, actor: Checkpointable, trainer_state: dict[str, Any]) -> Path:
    """Write step `step`'s checkpoint under `run_dir/checkpoints`, then point `latest` at it
    (a whole new file renamed over the old: a kill at any moment leaves one pointer or the other,
    never an empty one that would make a resumed run start over)."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step}"
    partial = root / f".step_{step}.partial"
    if partial.exists():  # a run killed while saving this step left it: none of it is kept
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    actor.save(partial / "model")  # what engines and users load
    actor.save_training_state(partial / TRAINING_STATE)
    (partial / "trainer_state.json").write_text(json.dumps(trainer_state))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)  # a checkpoint exists only once it is complete
    staged = root / ".latest.partial"
    staged.write_text(final.name)
    os.replace(staged, root / "latest")
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names, if it is whole; None for a fresh run."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    checkpoint = run_dir / "checkpoints" / pointer.read_text().strip()
    return checkpoint if (checkpoint / "trainer_state.json").is_file() else None
