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

import json
import math
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any

_VAL_ID = re.compile(r"^val-(\d+)-(\d+)$")


def heldout_rewards(store: str | Path) -> dict[int, dict[int, float]]:
    """{step: {task index: reward}} of the finished held-out rollouts in a run's store.db
    (their `data_id` is in the rollout's metadata)."""
    path = Path(store)
    if path.is_dir():
        path = path / "store.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rewards: dict[str, float] = {}
        for rollout_id, data in db.execute(
            "SELECT rollout_id, data FROM events WHERE event_type = 'reward' ORDER BY event_id"
        ):
            value = json.loads(data).get("value")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rewards[rollout_id] = float(value)  # the last reward event wins
        out: dict[int, dict[int, float]] = {}
        for rollout_id, raw in db.execute(
            "SELECT rollout_id, metadata FROM rollouts WHERE is_train = 0 AND state IN ('succeeded', 'failed')"
        ):
            data = json.loads(raw)  # the trainer's metadata: {"data_id": ..., "enqueued_step": ...}
            match = _VAL_ID.match(str(data.get("data_id", ""))) if isinstance(data, dict) else None
            if match:
                step, index = int(match[1]), int(match[2])
                out.setdefault(step, {})[index] = rewards.get(rollout_id, 0.0)
        return out
    finally:
        db.close()


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
