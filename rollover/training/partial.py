"""Partial rollout, the trainer's side: what an update cut through, from the gateway's counts,
and how stale a group is, from its oldest token."""

from __future__ import annotations

from collections.abc import Iterable

from rollover.store.models import ProxyState, TripletBundle

# The gateway's running totals (`ProxyState`) -> the step's metric of what grew during the update.
_SPANNING = {
    "training/async/n_calls_spanning_update": "calls_spanning_update_total",
    "training/async/tokens_spanning_update": "tokens_spanning_update_total",
    "timing/engine_pause_s": "engine_frozen_seconds_total",
}


def spanning_metrics(before: ProxyState | None, after: ProxyState | None) -> dict[str, float]:
    """Calls in flight across the update's weight loads, their tokens sampled before a load,
    and how long the engines held them frozen: the growth of the gateway's totals between the
    state read as the rollout ended (`before`) and after the weight sync (`after`). 0 when
    either is missing (drain mode, or no update) and where a restarted gateway counts from 0."""
    if before is None or after is None:
        return dict.fromkeys(_SPANNING, 0.0)
    return {
        metric: float(max(0.0, getattr(after, total) - getattr(before, total))) for metric, total in _SPANNING.items()
    }


def oldest_token_version(bundles: Iterable[TripletBundle]) -> int | None:
    """The policy version of the oldest response token recorded in `bundles` (None: none yet)."""
    versions = [
        version
        for bundle in bundles
        for t in bundle.triplets
        if t.response_token_ids
        for version in ([v for _, v in t.response_version_spans] if t.response_version_spans else [t.policy_version])
        if version is not None
    ]
    return min(versions, default=None)
