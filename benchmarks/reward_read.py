"""The trainer's batch read of outcome rewards (`RolloutStore.rewards`) now that rewards may be
per turn, against the read before them (every reward event of the last attempt, the last one
winning), on one store: by default 10,000 rollouts x 20 recorded calls, each with a per-turn
reward after every call but the last and one terminal reward (`--terminal-only`: only the
terminal one, as every agent posted before). Target: at most 1.2x.

    .venv/bin/python benchmarks/reward_read.py [--rollouts 10000 --calls 20 --repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from rollover import codec
from rollover.store.models import RolloutCreate, RolloutState, StatusFields
from rollover.store.rows import reward_value
from rollover.store.sqlite import RolloutStore

BEFORE = (
    "SELECT e.rollout_id, e.data FROM events e JOIN rollouts r ON r.rollout_id = e.rollout_id"
    " AND r.last_attempt_id = e.attempt_id WHERE e.event_type = 'reward'"
    " AND e.rollout_id IN ({ids}) ORDER BY e.event_id"
)


def read_before(path: Path, ids: list[str]) -> dict[str, float | None]:
    """The query `rewards` ran before rewards per turn, on its own connection (as the store reads)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    found: dict[str, float | None] = dict.fromkeys(ids)
    try:
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            for row in conn.execute(BEFORE.format(ids=",".join("?" * len(chunk))), chunk):
                data = codec.loads_lenient(row["data"])
                found[row["rollout_id"]] = reward_value(
                    data if isinstance(data, dict) else {}, found[row["rollout_id"]]
                )
    finally:
        conn.close()
    return found


async def build(path: Path, rollouts: int, calls: int, per_turn: bool) -> list[str]:
    store = RolloutStore(path)
    ids: list[str] = []
    try:
        for start in range(0, rollouts, 500):
            created = await store.add_rollouts([RolloutCreate() for _ in range(min(500, rollouts - start))])
            ids += [r.rollout_id for r in created]
        running = StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1")
        await asyncio.gather(*(store.update_status(rid, running) for rid in ids))

        async def one(rid: str) -> None:
            for turn in range(calls):
                data = {
                    "call_id": f"{rid}-{turn}",
                    "prompt_token_ids": list(range(200 + 20 * turn)),
                    "response_token_ids": list(range(20)),
                    "response_logprobs": [-0.5] * 20,
                    "policy_version": 0,
                }
                await store.record_event(rid, "a1", "model_request", data)
                if per_turn and turn < calls - 1:
                    await store.record_event(rid, "a1", "reward", {"value": 0.1})
            await store.record_event(rid, "a1", "reward", {"value": 1.0})

        for start in range(0, len(ids), 200):
            await asyncio.gather(*(one(rid) for rid in ids[start : start + 200]))
    finally:
        store.close()
    return ids


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--terminal-only", action="store_true", help="one terminal reward a rollout, no per-turn ones")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "store.db"
        started = time.perf_counter()
        ids = await build(path, args.rollouts, args.calls, not args.terminal_only)
        print(f"built {args.rollouts} rollouts x {args.calls} calls in {time.perf_counter() - started:.0f} s")
        store = RolloutStore(path, read_only=True)
        try:
            before, now = [], []
            for _ in range(args.repeats):  # interleaved, so a change in load hits both alike
                started = time.perf_counter()
                old = await asyncio.to_thread(read_before, path, ids)
                before.append(time.perf_counter() - started)
                started = time.perf_counter()
                new = await store.rewards(ids)
                now.append(time.perf_counter() - started)
        finally:
            store.close()
    assert all(value == 1.0 for value in new.values())  # the outcome: per-turn rewards are not it
    assert all(value == 1.0 for value in old.values())  # the terminal reward was the last one too
    ratio = statistics.median(now) / statistics.median(before)
    print(f"load average {os.getloadavg()[0]:.1f}; median of {args.repeats} reads of {len(ids)} rollouts:")
    print(f"  before rewards per turn: {statistics.median(before):.3f} s")
    print(f"  now:                     {statistics.median(now):.3f} s  ({ratio:.2f}x; target <= 1.2x)")


if __name__ == "__main__":
    asyncio.run(main())
