"""`trainer.setup_hook` of the vision calc example: data files and, when no model is given, the
tiny vision-language model built locally and warmed up on the task. Everything is cached."""

from __future__ import annotations

import os
import random
from pathlib import Path

from examples.calc.task import PROSE_ANSWER
from examples.vision_calc.task import demonstration, make_tasks
from rollover.config import RolloverConfig
from rollover.training.data import default_task_files

TRAIN_SIZE, VAL_SIZE = 2000, 128
# 2,000 steps: the reading is learned late (the loss drops from ~0.5 to under 0.1 between steps
# ~900 and ~1,400); 800 steps left the digits at chance.
WARMUP_STEPS = int(os.environ.get("ROLLOVER_VISION_CALC_WARMUP_STEPS", "2000"))
WARMUP_LR = float(os.environ.get("ROLLOVER_VISION_CALC_WARMUP_LR", "3e-3"))
# The vision tower stays as built (random, frozen): its features already tell the glyphs apart
# (a linear probe on them: 100%), while training it (at 3e-3, and at 3e-4) collapsed them onto one
# large shared direction (norm ~80, cosine ~1.0 between pictures) and the loss stalled near 0.6.
WARMUP_VISION_LR = float(os.environ.get("ROLLOVER_VISION_CALC_WARMUP_VISION_LR", "0"))
# As in the calc example: the warm-up always reads the image and uses the calculator, but 60% of
# its transcripts end in prose the grader does not accept, so RL has the protocol to learn.
PROSE_FRACTION = 0.6
MODEL_NAME = (
    f"tiny-vl-warm{WARMUP_STEPS}-lr{WARMUP_LR:g}-vlr{WARMUP_VISION_LR:g}-prose{round(PROSE_FRACTION * 100)}-mrope1-1"
)


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "vision_calc"
    default_task_files(
        config.data,
        cache,
        lambda: make_tasks(TRAIN_SIZE, seed=1),
        lambda: make_tasks(VAL_SIZE, seed=2, start=TRAIN_SIZE),
    )
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(tiny_vision_calc_model(cache / MODEL_NAME))
    return config


def warmup_transcripts(count: int = 3000) -> list[list[dict]]:
    rng = random.Random(5)
    return [
        # Each transcript a rendering of its own (seeded jitter), unlike the agent's fixed one.
        demonstration(task, PROSE_ANSWER if rng.random() < PROSE_FRACTION else "ANSWER: {}", seed=index)
        for index, task in enumerate(make_tasks(count, seed=4, start=10_000))
    ]


def tiny_vision_calc_model(out: Path, steps: int = WARMUP_STEPS) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.tiny_vl import build_tiny_vl_model
    from rollover.modelzoo.warmup import sft_warmup

    base = out.with_name("tiny-vl-base-mrope1-1")
    if not (base / "config.json").exists():
        build_tiny_vl_model(base, seed=0, max_image_tokens=16)
    # One thread: measured 8-12x faster than two for a tiny model on shared cores (warmup.py).
    sft_warmup(
        base,
        warmup_transcripts(),
        out,
        steps=steps,
        lr=WARMUP_LR,
        vision_lr=WARMUP_VISION_LR,
        batch_size=16,
        seed=0,
        num_threads=1,
    )
    return out
