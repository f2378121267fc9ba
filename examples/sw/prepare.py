"""`trainer.setup_hook` of the ScienceWorld example: task files split by variation (the
simulator's own train and dev variations), and, when no model is given, a tiny model built and
warmed up on demonstrations played from other train variations' gold paths. Everything is
cached under `runs/_cache/sw`, so a second run starts at RL. For local agents it also starts
the run's pool of ScienceWorld JVMs (`jvm_pool`; one per agent slot, or ROLLOVER_SW_JVMS, 0 for
none), which lives as long as this process."""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from examples.sw.demonstrations import Message, transcripts
from examples.sw.jvm_pool import POOL_ENV, JVMPool
from examples.sw.task import TASK_NAMES, ScienceWorld, make_tasks
from rollover.config import RolloverConfig
from rollover.jsonl import jsonl_values
from rollover.training.data import write_tasks

# Per quest: RL tasks from the first TRAIN_PER_TASK train variations, demonstrations from the
# next DEMOS_PER_TASK (no task is both), held-out tasks from the dev variations.
TRAIN_PER_TASK, DEMOS_PER_TASK, VAL_PER_TASK = 100, 50, 25
# Share of demonstrations that say each action in prose ("I will ...") instead of the
# `ACTION:` line: the plan is the same, but the agent reads no action in it and the task is
# never done. The warmed-up policy knows the plans and is unsure of the protocol.
PROSE_FRACTION = 0.5
WARMUP_STEPS = int(os.environ.get("ROLLOVER_SW_WARMUP_STEPS", "300"))
MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "vocab_size": 2048, "max_position_embeddings": 4096}
MODEL_NAME = (
    f"tiny{MODEL['hidden_size']}x{MODEL['num_layers']}-warm{WARMUP_STEPS}"
    f"-demos{DEMOS_PER_TASK}-prose{round(PROSE_FRACTION * 100)}"
)


def prepare(config: RolloverConfig) -> RolloverConfig:
    cache = Path(config.trainer.default_local_dir) / "_cache" / "sw"
    data = config.data
    if data.train_files is None or data.val_files is None:
        files = write_task_files(cache)
        data.train_files = data.train_files or str(files["train"])
        data.val_files = data.val_files or str(files["val"])
    model = config.actor_rollout_ref.model
    if model.path is None:
        model.path = str(tiny_sw_model(cache / MODEL_NAME, demonstrations(cache)))
    local = config.agentlightning.local
    size = _pool_size(local.max_concurrency)
    if config.agentlightning.runner == "local" and size > 0 and POOL_ENV not in local.env:
        pool = JVMPool(Path(tempfile.mkdtemp(prefix="rollover-sw-jvms-")), size).start()
        if not _POOLS:
            atexit.register(stop_jvm_pools)  # and if this process is killed, the JVMs see their stdin end
        _POOLS.append(pool)
        local.env[POOL_ENV] = str(pool.folder)
    return config


def _pool_size(default: int) -> int:
    raw = os.environ.get("ROLLOVER_SW_JVMS")
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"ROLLOVER_SW_JVMS must be a number of JVMs (0 for none), got {raw!r}") from None


# The JVM pools this process started (one per run it prepared); they live as long as it does.
_POOLS: list[JVMPool] = []


def stop_jvm_pools() -> None:
    """Stops every JVM pool this process started (at exit; a test that trains in-process calls it)."""
    while _POOLS:
        _POOLS.pop().close()


def write_task_files(folder: Path) -> dict[str, Path]:
    """train.jsonl and val.jsonl: the same quests, different variations of each."""
    paths = {"train": folder / "train.jsonl", "val": folder / "val.jsonl"}
    if all(p.exists() for p in paths.values()):
        return paths
    splits = variation_splits(folder / "variations.json")
    write_tasks(paths["val"], make_tasks(splits, "val", VAL_PER_TASK))
    write_tasks(paths["train"], make_tasks(splits, "train", TRAIN_PER_TASK))
    return paths


def variation_splits(cache_file: Path) -> dict[str, dict[str, list[int]]]:
    """Each quest's train and val variations, read from the simulator once (one JVM)."""
    if cache_file.exists():
        return json.loads(cache_file.read_text())
    with ScienceWorld() as world:
        splits = {name: world.variations(name) for name in TASK_NAMES}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(splits))
    return splits


def demonstration_tasks(splits: dict[str, dict[str, list[int]]]) -> list[dict[str, Any]]:
    """The train variations after the RL tasks' ones, DEMOS_PER_TASK of each quest."""
    beyond = {name: {"train": split["train"][TRAIN_PER_TASK:]} for name, split in splits.items()}
    return make_tasks(beyond, "train", DEMOS_PER_TASK)


def demonstrations(folder: Path) -> list[list[Message]]:
    """The warm-up's conversations, played once and cached."""
    path = folder / f"demos{DEMOS_PER_TASK}-prose{round(PROSE_FRACTION * 100)}.jsonl"
    if not path.exists():
        tasks = demonstration_tasks(variation_splits(folder / "variations.json"))
        played = transcripts(tasks, PROSE_FRACTION, seed=0)
        write_tasks(path, [{"messages": messages, "score": score} for messages, score in played])
    return [row["messages"] for _, row in jsonl_values(path)]


def tiny_sw_model(out: Path, chats: list[list[Message]]) -> Path:
    if (out / "config.json").exists():
        return out
    from rollover.modelzoo.tiny import build_tiny_model
    from rollover.modelzoo.warmup import sft_warmup

    base = out.with_name(f"tiny{MODEL['hidden_size']}x{MODEL['num_layers']}-base")
    if not (base / "config.json").exists():
        corpus = [message["content"] for chat in chats for message in chat]
        build_tiny_model(base, corpus=corpus, seed=0, **MODEL)  # type: ignore[arg-type]
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    metrics = sft_warmup(
        base,
        chats,
        staging,
        steps=WARMUP_STEPS,
        lr=3e-3,
        batch_size=8,
        seed=0,
        max_length=4096,
        num_threads=int(os.environ.get("ROLLOVER_SW_WARMUP_THREADS", "2")),
    )
    print(
        f"sw warm-up: {WARMUP_STEPS} steps in {metrics['seconds']:.0f} s, loss "
        f"{metrics['initial_loss']:.3f} -> {metrics['final_loss']:.3f}",
        flush=True,
    )
    staging.rename(out)
    return out
