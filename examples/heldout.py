"""Held-out reward before and after training, paired by task, from a run's store.

    python -m examples.heldout runs/gsm8k            # or a path to store.db

The trainer evaluates `data.val_files` at step 0 and at the end; its held-out rollouts have
the data_id `val-<step>-<i>`, task i being the same at every step. For the first and the last
evaluated step this prints the mean reward, and the mean paired difference (last - first)
over the tasks evaluated at both with its standard error, sd(d) / sqrt(n). A finished rollout
without a reward (failed, timed out) counts as 0, as the trainer's val/reward does; one still
queued or running (an evaluation under way) is left out, and the line says how many tasks each
step has.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
from pathlib import Path
from typing import Any

from rollover.store.models import RolloutState
from rollover.store.sqlite import RolloutStore

_VAL_ID = re.compile(r"^val-(\d+)-(\d+)$")


def heldout_rewards(store: str | Path) -> dict[int, dict[int, float]]:
    """{step: {task index: reward}} of the finished held-out rollouts in a run's store.db
    (their `data_id` is in the rollout's metadata), each reward the store's outcome of the
    rollout's last attempt (`RolloutStore.rewards`, as the trainer reads it: a reward naming a
    call, or one another call follows, is that turn's, not the outcome)."""
    path = Path(store)
    if path.is_dir():
        path = path / "store.db"
    return asyncio.run(_heldout_rewards(RolloutStore(path, read_only=True)))


async def _heldout_rewards(store: RolloutStore) -> dict[int, dict[int, float]]:
    try:
        finished = [
            rollout
            for rollout in await store.list_rollouts(state_in=[s for s in RolloutState if s.terminal])
            if not rollout.is_train
        ]
        outcomes = await store.rewards(rollout.rollout_id for rollout in finished)
    finally:
        store.close()
    out: dict[int, dict[int, float]] = {}
    for rollout in finished:  # the trainer's metadata: {"data_id": ..., "enqueued_step": ...}
        match = _VAL_ID.match(str(rollout.metadata.get("data_id", "")))
        if match:
            out.setdefault(int(match[1]), {})[int(match[2])] = outcomes.get(rollout.rollout_id) or 0.0
    return out


def paired_difference(before: dict[int, float], after: dict[int, float]) -> dict[str, Any]:
    """Means over the tasks in both, the mean paired difference and its standard error."""
    tasks = sorted(before.keys() & after.keys())
    n = len(tasks)
    if n < 2:
        raise ValueError(f"need at least 2 tasks evaluated at both steps, got {n}")
    diffs = [after[i] - before[i] for i in tasks]
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return {
        "n": n,
        "before": sum(before[i] for i in tasks) / n,
        "after": sum(after[i] for i in tasks) / n,
        "diff": mean,
        "se": sd / math.sqrt(n),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    steps = heldout_rewards(argv[0])
    if len(steps) < 2:
        print(f"held-out evaluations at steps {sorted(steps)}: need two", file=sys.stderr)
        return 1
    first, last = min(steps), max(steps)
    r = paired_difference(steps[first], steps[last])
    if len(steps[first]) != len(steps[last]):
        print(f"step {first}: {len(steps[first])} tasks finished, step {last}: {len(steps[last])} (paired over both)")
    print(
        f"held-out, {r['n']} tasks: step {first} {r['before']:.3f} -> step {last} {r['after']:.3f}; "
        f"paired difference {r['diff']:+.3f} ± {r['se']:.3f} (SE), {r['diff'] / r['se'] if r['se'] else math.inf:.1f} SE"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
