"""Samples made of a run's recorded rollouts: merging by prefix (Rollover's rule: a call extends
the longest sample its prompt starts with) against the in-order merge it replaced (a call
extends only the sample of the call just before it). Prints, per rule, samples per rollout,
the tokens an update computes (every sample's whole sequence) and the tokens it trains.

    .venv/bin/python benchmarks/sample_merge.py runs/harness_claude_code/store.db [--limit 200]

Interleaved sessions (a harness's sub-agent, its side calls for a title or a summary) broke the
in-order merge: each turn after a switch started a new sample whose context repeated the whole
conversation so far.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rollover.store.models import RolloutState
from rollover.store.sqlite import RolloutStore
from rollover.training.samples import build_samples


def in_order_merge(triplets: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """The rule before: a call extends only the sample of the call just before it (per policy).
    Each sample's length and its trained (response) tokens."""
    sequences: list[list[int]] = []
    trained: list[int] = []
    previous: dict[Any, int] = {}
    for triplet in triplets:
        prompt, response = list(triplet["prompt_token_ids"]), list(triplet["response_token_ids"])
        policy = triplet.get("policy")
        last = previous.get(policy)
        if last is not None and prompt[: len(sequences[last])] == sequences[last]:
            sequences[last] = prompt + response
            trained[last] += len(response)
        else:
            last = len(sequences)
            sequences.append(prompt + response)
            trained.append(len(response))
        previous[policy] = last
    return [(len(sequence), count) for sequence, count in zip(sequences, trained)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="a run's store.db")
    parser.add_argument("--limit", type=int, default=1000, help="at most this many finished rollouts")
    args = parser.parse_args()
    store = RolloutStore(args.store, read_only=True)
    try:
        rollouts = await store.list_rollouts(state_in=[RolloutState.SUCCEEDED, RolloutState.FAILED], limit=args.limit)
        rows: dict[str, list[tuple[int, int, int, int]]] = {"prefix": [], "in order": []}
        for rollout in rollouts:
            bundle = await store.triplets(rollout.rollout_id)
            triplets = [t.model_dump() for t in bundle.triplets]
            if not triplets:
                continue
            prefix = build_samples(rollout.rollout_id, "g", triplets, reward=0.0, max_length=None)
            rows["prefix"].append(
                (len(triplets), len(prefix), sum(len(s) for s in prefix), sum(s.num_loss_tokens for s in prefix))
            )
            ordered = in_order_merge(triplets)
            rows["in order"].append(
                (len(triplets), len(ordered), sum(n for n, _ in ordered), sum(t for _, t in ordered))
            )
    finally:
        store.close()
    print(f"{len(rows['prefix'])} rollouts with recorded calls in {args.store}")
    print(f"{'merge':<10} {'calls/rollout':>14} {'samples/rollout':>16} {'tokens computed':>16} {'tokens trained':>15}")
    for rule, found in rows.items():
        if not found:
            continue
        calls, samples, computed, trained = (statistics.mean(column) for column in zip(*found))
        print(f"{rule:<10} {calls:>14.2f} {samples:>16.2f} {computed:>16.0f} {trained:>15.0f}")
    if rows["prefix"]:
        ratio = sum(r[2] for r in rows["in order"]) / max(1, sum(r[2] for r in rows["prefix"]))
        print(f"tokens computed, in order / prefix: {ratio:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
