"""`trainer.setup_hook` of the calc example: data files and, when no model is given, a tiny
model built locally and warmed up on the protocol. Everything is cached and reused."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

from examples.calc.task import PROSE_ANSWER, demonstration, make_tasks
from rollover.config import RolloverConfig
from rollover.training.data import default_task_files

TRAIN_SIZE, VAL_SIZE = 2000, 128
# Long enough that the tiny model copies operands and the tool's result reliably (at 300
# steps, with the mixed endings below, it has not learned to copy yet).
WARMUP_STEPS = int(os.environ.get("ROLLOVER_CALC_WARMUP_STEPS", "600"))
# Share of warm-up transcripts that end in prose ("The answer is 82.") instead of the
# protocol's "ANSWER: 82". The arithmetic is right in both, but only the protocol earns a
# reward, so the starting policy is unsure of a decision that RL must learn from the reward
# alone, and the held-out reward has room to rise within a few updates.
PROSE_FRACTION = 0.6
MODEL_NAME = f"tiny-warm{WARMUP_STEPS}-prose{round(PROSE_FRACTION * 100)}"
# SmolLM2 knows arithmetic prose but not the protocol (zero-shot it never earns a reward);
# 40 steps on the same transcripts teach it the tool call and leave the ending undecided.
SMOLLM2_WARMUP_STEPS = 40
SMOLLM2_MODEL_NAME = f"smollm2-warm{SMOLLM2_WARMUP_STEPS}-prose{round(PROSE_FRACTION * 100)}"


def prepare(config: RolloverConfig) -> RolloverConfig:
    """Data files, and the tiny model when none is given."""
    return _prepare(config, tiny_calc_model, MODEL_NAME)


def prepare_smollm2(config: RolloverConfig) -> RolloverConfig:
    """Data files, and SmolLM2-135M-Instruct warmed up on the protocol when no model is given
    (`config_smollm2.yaml`): the real-model run."""
    return _prepare(config, smollm2_calc_model, SMOLLM2_MODEL_NAME)


def _prepare(config: RolloverConfig, build: Callable[[Path], Path], model_name: str) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "calc"
    default_task_files(
        config.data,
        cache,
        lambda: make_tasks(TRAIN_SIZE, seed=1),
        lambda: make_tasks(VAL_SIZE, seed=2, start=TRAIN_SIZE),
    )
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(build(cache / model_name))
    return config


def warmup_transcripts(count: int = 4000) -> list[list[dict[str, str]]]:
    rng = random.Random(5)
    return [
        demonstration(task, PROSE_ANSWER if rng.random() < PROSE_FRACTION else "ANSWER: {}")
        for task in make_tasks(count, seed=4, start=10_000)
    ]


def tiny_calc_model(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.tiny import build_tiny_model
    from rollover.modelzoo.warmup import sft_warmup

    base = out.with_name("tiny-base")
    if not (base / "config.json").exists():
        corpus = [m["content"] for task in make_tasks(500, seed=3) for m in demonstration(task)]
        build_tiny_model(base, corpus=corpus, seed=0)
    sft_warmup(base, warmup_transcripts(), out, steps=WARMUP_STEPS, lr=3e-3, batch_size=16, seed=0)
    return out


def smollm2_calc_model(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.smollm2 import cached_smollm2
    from rollover.modelzoo.warmup import sft_warmup

    base = cached_smollm2(out.parent.parent / "smollm2")  # shared with the other examples
    sft_warmup(base, warmup_transcripts(2000), out, steps=SMOLLM2_WARMUP_STEPS, lr=5e-5, batch_size=16, seed=0)
    return out
