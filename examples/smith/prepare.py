"""`trainer.setup_hook` of the smith example: synthesise the buggy repos (each bug checked in
the sandbox: it must break a test), split them into train and held-out bugs, and, when no model
is given, build a tiny model and warm it up on demonstrations made from train bugs' known fixes.
Everything is cached under `runs/_cache/smith`, so a second run starts at RL."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from examples.smith.agent import SYSTEM_PROMPT
from examples.smith.demos import demonstration
from examples.smith.task import TEMPLATES, RepoTemplate, make_tasks
from rollover.config import RolloverConfig
from rollover.training.data import write_tasks

MAX_TASKS, VAL_SIZE, SEED = 1000, 120, 0  # the 8 templates yield 245 distinct bugs
WARMUP_STEPS = int(os.environ.get("ROLLOVER_SMITH_WARMUP_STEPS", "1000"))
# Share of demonstrations that write the same write_file call in a ```json markdown block instead
# of the <tool> tag: the code is the same, but the agent takes a reply without a tool call as its final
# answer, so the repo is unchanged and the reward 0. The warmed-up policy knows the fix and is
# unsure of the protocol, which RL must learn from the reward alone (as in calc and gsm8k).
MARKDOWN_FRACTION = 0.5
DEMOS_PER_TASK = 4
MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "vocab_size": 2048}
MODEL_NAME = f"tiny{MODEL['hidden_size']}x{MODEL['num_layers']}-warm{WARMUP_STEPS}-md{round(MARKDOWN_FRACTION * 100)}"


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "smith"
    data = config.data
    train_path, val_path = cache / "train.jsonl", cache / "val.jsonl"
    model = config.actor_rollout_ref.model
    if data.train_files is None or data.val_files is None or model.path is None:
        if not (train_path.exists() and val_path.exists()):
            train, val = split_tasks()
            write_tasks(val_path, val)
            write_tasks(train_path, train)
        data.train_files = data.train_files or str(train_path)
        data.val_files = data.val_files or str(val_path)
    if model.path is None:  # warmed up on the cached train split's bugs only
        model.path = str(tiny_smith_model(cache / MODEL_NAME, train_path))
    return config


def split_tasks(
    templates: tuple[RepoTemplate, ...] = TEMPLATES, val_size: int = VAL_SIZE
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): every bug the templates yield, shuffled; the first `val_size` held out."""
    tasks = make_tasks(MAX_TASKS, seed=SEED, templates=templates)
    random.Random(SEED).shuffle(tasks)
    return tasks[val_size:], tasks[:val_size]


def warmup_transcripts(train: list[dict[str, Any]], per_task: int = DEMOS_PER_TASK) -> list[list[dict[str, str]]]:
    """Demonstrations of train bugs only; MARKDOWN_FRACTION of them fail the protocol."""
    rng = random.Random(5)
    return [
        demonstration(task, protocol_ok=rng.random() >= MARKDOWN_FRACTION) for task in train for _ in range(per_task)
    ]


def tokenizer_corpus(templates: tuple[RepoTemplate, ...] = TEMPLATES) -> list[str]:
    """The protocol and the templates' code, raw and as a JSON string, so both tokenize compactly."""
    from examples.smith.demos import fenced_call, tool_call

    corpus = [SYSTEM_PROMPT]
    for template in templates:
        for path, content in template.files.items():
            corpus += [
                content,
                tool_call("write_file", path=path, content=content),
                fenced_call("write_file", path=path, content=content),
            ]
    return corpus


def tiny_smith_model(
    out: Path, train_path: Path, steps: int = WARMUP_STEPS, templates: tuple[RepoTemplate, ...] = TEMPLATES
) -> Path:
    """The tiny model, its tokenizer made for `templates`, warmed up for `steps` on
    demonstrations of the bugs in `train_path`; built once into `out`."""
    if (out / "config.json").exists():
        return out
    from rollover.jsonl import jsonl_values
    from rollover.modelzoo.tiny import build_tiny_model
    from rollover.modelzoo.warmup import sft_warmup

    # the base's tokenizer is made for `templates`, so a base built for others is not reused
    only = "" if templates == TEMPLATES else "-" + "-".join(t.name for t in templates)
    base = out.with_name(f"tiny{MODEL['hidden_size']}x{MODEL['num_layers']}{only}-base")
    if not (base / "config.json").exists():
        build_tiny_model(base, corpus=tokenizer_corpus(templates), seed=0, **MODEL)
    train = [row for _, row in jsonl_values(train_path)]
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    metrics = sft_warmup(
        base,
        warmup_transcripts(train),
        staging,
        steps=steps,
        lr=3e-3,
        batch_size=8,
        seed=0,
        max_length=1024,
        num_threads=int(os.environ.get("ROLLOVER_SMITH_WARMUP_THREADS", "2")),
    )
    print(
        f"smith warm-up: {steps} steps in {metrics['seconds']:.0f} s, loss "
        f"{metrics['initial_loss']:.3f} -> {metrics['final_loss']:.3f}",
        flush=True,
    )
    staging.rename(out)
    return out
