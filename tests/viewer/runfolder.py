"""A small run folder written through the store's and the metrics logger's own writers: every
case the viewer must show (a retried attempt, an aborted group, a tool call, held-out rollouts)
in a few kilobytes. The recorded real run in tests/viewer/data/ covers what a real run writes."""

from __future__ import annotations

import asyncio
import shutil
import tarfile
from pathlib import Path

from rollover.config import dump_config, load_config
from rollover.metrics import MetricsLogger
from rollover.store import EventCreate, RolloutCreate, RolloutState, RolloutStore, StatusFields

RECORDED_RUN = Path(__file__).parent / "data" / "calc-run.tar.gz"

WORDS = [
    "<pad>",
    "<eos>",
    "what",
    "is",
    "2",
    "+",
    "3",
    "?",
    "CALL",
    "calc(2+3)",
    "=",
    "5",
    "ANSWER:",
    "user",
    "assistant",
]


def write_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def call_event(prompt: str, response: str, version: int, tool: bool = False) -> EventCreate:
    response_ids = ids(response)
    messages = [{"role": "user", "content": "what is 2 + 3 ?"}]
    if tool:
        messages += [
            {"role": "assistant", "content": "CALL calc(2+3)"},
            {"role": "tool", "content": "5"},
        ]
    return EventCreate(
        event_type="model_request",
        data={
            "mode": "train",
            "endpoint": "chat/completions",
            "request": {"model": "policy", "messages": messages, "max_tokens": 24},
            "response": {
                "choices": [{"message": {"role": "assistant", "content": response}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(ids(prompt)), "completion_tokens": len(response_ids)},
            },
            "policy_version": version,
            "latency_s": 0.05,
            "status_code": 200,
            "prompt_token_ids": ids(prompt),
            "response_token_ids": response_ids,
            "response_logprobs": [-0.25] * len(response_ids),
        },
    )


async def _fill(store: RolloutStore) -> None:
    async def rollout(rid: str, group: str, step: int, *, is_train: bool = True) -> None:
        await store.add_rollouts(
            [RolloutCreate(rollout_id=rid, is_train=is_train, metadata={"data_id": group, "enqueued_step": step})]
        )

    async def run(rid: str, attempt: str | None = None) -> str:
        # named as Rollover's controller names them: a1, a2...
        attempt = attempt or f"a{len(store.snapshot(rid).attempts) + 1}"
        fields = StatusFields(state=RolloutState.RUNNING, last_attempt_id=attempt)
        return (await store.update_status(rid, fields)).status.last_attempt_id or ""

    async def finish(rid: str, state: RolloutState, error: str | None = None) -> None:
        fields = StatusFields(state=state, error_message=error) if error else StatusFields(state=state)
        await store.update_status(rid, fields)

    async def reward(rid: str, attempt: str, value: float) -> None:
        await store.add_event(rid, attempt, EventCreate(event_type="reward", data={"value": value}))

    # group g0 (enqueued by the first step): a two-turn rollout with a tool call (merged into one sample), and a
    # sibling whose first attempt failed and whose second one answered wrongly.
    await rollout("r-g0-0", "g0", 0)
    await rollout("r-g0-1", "g0", 0)
    a = await run("r-g0-0")
    await store.add_event("r-g0-0", a, call_event("user what is 2 + 3 ? assistant", "CALL calc(2+3)", 0))
    await store.add_event(
        "r-g0-0",
        a,
        call_event("user what is 2 + 3 ? assistant CALL calc(2+3) user = 5 assistant", "ANSWER: 5 <eos>", 0, tool=True),
    )
    await reward("r-g0-0", a, 1.0)
    await finish("r-g0-0", RolloutState.SUCCEEDED)
    a = await run("r-g0-1")
    await finish("r-g0-1", RolloutState.QUEUING, error="agent exited with code 1")  # retried
    a = await run("r-g0-1")
    await store.add_event("r-g0-1", a, call_event("user what is 2 + 3 ? assistant", "ANSWER: 3 <eos>", 1))
    await reward("r-g0-1", a, 0.0)
    await finish("r-g0-1", RolloutState.SUCCEEDED)
    # group g1 (enqueued by the second step): carried over, then aborted when training finished.
    await rollout("r-g1-0", "g1", 1)
    await rollout("r-g1-1", "g1", 1)
    a = await run("r-g1-0")
    await store.add_event("r-g1-0", a, call_event("user what is 2 + 3 ? assistant", "ANSWER: 5 <eos>", 1))
    await reward("r-g1-0", a, 1.0)
    await finish("r-g1-0", RolloutState.SUCCEEDED)
    await finish("r-g1-1", RolloutState.FAILED, error="aborted: training finished")
    # a held-out rollout after step 0
    await rollout("val-0-0", "val-0-0", 0, is_train=False)
    a = await run("val-0-0")
    await reward("val-0-0", a, 1.0)
    await finish("val-0-0", RolloutState.SUCCEEDED)


def write_run(run_dir: Path) -> Path:
    """store.db, metrics.jsonl, config.yaml and a checkpoint's tokenizer, as a run leaves them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(
        None, ["actor_rollout_ref.rollout.n=2", "data.train_batch_size=1", "trainer.total_training_steps=2"]
    )
    (run_dir / "config.yaml").write_text(dump_config(config))
    store = RolloutStore(run_dir / "store.db")
    try:
        asyncio.run(_fill(store))
    finally:
        store.close()
    write_tokenizer(run_dir / "checkpoints" / "step_2" / "model")
    (run_dir / "checkpoints" / "latest").write_text("step_2")
    logger = MetricsLogger(run_dir, ["jsonl"])
    logger.log(0, {"val/reward_mean": 0.5})
    for step in (1, 2):
        logger.log(
            step,
            {
                "critic/score/mean": 0.25 * step,
                "training/async/n_prev_carry_over_rollouts": 2 * (step - 1),
                "training/async/n_completed_rollouts": 2,
                "training/async/n_new_carry_over_rollouts": 2,
                "training/async/new_carry_over_age_max_steps": step,
                "training/async/proxy_inflight_at_pause": 1,
                "training/async/proxy_drain_seconds": 0.2,
                "timing/step_s": 3.0,
                "timing/rollout_wait_s": 1.5,
                "timing/update_s": 1.0,
                "timing/weight_sync_s": 0.2,
                "timing/gateway_pause_s": 1.6 if step > 1 else 0.0,
            },
        )
    logger.log(2, {"val/reward_mean": 0.75})
    logger.close()
    return run_dir


def recorded_run(into: Path) -> Path:
    """The committed real run (`rollover train examples/calc/config.yaml`, 3 async steps),
    unpacked into a scratch folder: opening a store read-only still creates its -shm file."""
    with tarfile.open(RECORDED_RUN) as archive:
        archive.extractall(into, filter="data")
    [run_dir] = [p for p in into.iterdir() if p.is_dir()]
    return run_dir


def copy_run(source: Path, into: Path) -> Path:
    return Path(shutil.copytree(source, into))
