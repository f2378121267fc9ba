"""Partial rollout, the trainer's side: no pause and no drain, samples whose tokens carry the
versions that sampled them, a staleness cap counted from a group's oldest token, and the counts
of what an update cut through."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollover.config import ConfigError, load_config
from rollover.simulate import LogNormal, Scenario, Simulation
from rollover.store.models import ProxyState, Triplet, TripletBundle
from rollover.training.manager import TrackedRollout
from rollover.training.partial import oldest_token_version, spanning_metrics
from rollover.training.samples import build_samples, token_versions
from rollover.training.settings import TrainerSettings
from rollover.training.trainer import Trainer
from tests.training.scripted_backend import ScriptedBackend

PARTIAL = ["agentlightning.async_rollout.partial_rollout=true"]


def test_partial_rollout_needs_async_mode() -> None:
    with pytest.raises(ConfigError, match="partial_rollout=true needs agentlightning.async_rollout.enabled=true"):
        load_config(None, PARTIAL)


def test_each_response_token_carries_the_version_of_its_span() -> None:
    call = {
        "prompt_token_ids": [1, 2],
        "response_token_ids": [10, 11, 12, 13, 14],
        "response_logprobs": [-0.1] * 5,
        "policy_version": 3,
        "response_version_spans": [[0, 3], [2, 4], [4, 6]],
    }
    (sample,) = build_samples("r", "g", [call], reward=1.0, max_length=None)
    assert sample.token_versions == [-1, -1, 3, 3, 4, 4, 6]
    # A call recorded without spans (drain mode, or before partial rollout) is all its version.
    (plain,) = build_samples("r", "g", [call | {"response_version_spans": None}], reward=1.0, max_length=None)
    assert plain.token_versions == [-1, -1, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="do not cover"):
        token_versions([[0, 3], [9, 4]], 3, 5)


def _bundle(*calls: tuple[list[int], list[list[int]] | None, int]) -> TripletBundle:
    triplets = [
        Triplet(
            event_id=i,
            prompt_token_ids=[1],
            response_token_ids=response,
            policy_version=version,
            response_version_spans=None if spans is None else [(s, v) for s, v in spans],
        )
        for i, (response, spans, version) in enumerate(calls)
    ]
    return TripletBundle(rollout_id="r", attempt_id="a1", reward=None, triplets=triplets)


def test_the_oldest_token_is_read_from_spans_and_versions() -> None:
    assert oldest_token_version([_bundle(([5, 6], [[0, 4], [1, 5]], 4)), _bundle(([7], None, 3))]) == 3
    assert oldest_token_version([_bundle(([], None, 1), ([5], [[0, 6]], 6))]) == 6  # an empty answer has no token
    assert oldest_token_version([_bundle()]) is None


def test_what_an_update_cut_through_is_the_growth_of_the_gateways_counts() -> None:
    def state(calls: int, tokens: int, frozen: float) -> ProxyState:
        return ProxyState(
            paused=False,
            retry_after_seconds=5,
            reason=None,
            inflight=4,
            calls_spanning_update_total=calls,
            tokens_spanning_update_total=tokens,
            engine_frozen_seconds_total=frozen,
        )

    assert spanning_metrics(state(2, 100, 1.0), state(5, 400, 1.25)) == {
        "training/async/n_calls_spanning_update": 3.0,
        "training/async/tokens_spanning_update": 300.0,
        "timing/engine_pause_s": 0.25,
    }
    assert set(spanning_metrics(None, None).values()) == {0.0}  # drain mode
    assert set(spanning_metrics(state(2, 100, 1.0), state(0, 0, 0.0)).values()) == {0.0}  # a restarted gateway


class _Recorded:
    """`GatewayClient.triplets` over recorded calls, by rollout id: (version spans) per call."""

    def __init__(self, spans: dict[str, list[list[list[int]]]]) -> None:
        self.spans = spans

    async def triplets(self, rollout_id: str) -> TripletBundle:
        return _bundle(*(([9] * 8, spans, spans[0][1]) for spans in self.spans.get(rollout_id, [])))


def test_the_staleness_cap_counts_from_a_groups_oldest_token() -> None:
    overrides = [
        "data.train_batch_size=1",
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "agentlightning.async_rollout.max_carry_over_age_steps=1",
        *PARTIAL,
    ]
    client = _Recorded(
        {
            "young-1": [[[0, 4], [5, 5]]],  # enqueued 5 updates ago, its oldest token 1 update old
            "old-1": [[[0, 4]]],
            "old-2": [[[0, 2], [3, 4]]],  # a call that went on across two updates: 3 updates old
            # "unstarted-1": no call yet
        }
    )
    backend = ScriptedBackend()
    trainer = Trainer(
        settings=TrainerSettings.from_config(load_config(None, overrides)),
        client=client,  # type: ignore[arg-type]
        actor=None,  # type: ignore[arg-type]
        weight_sync=None,  # type: ignore[arg-type]
        train_tasks=[{"id": i} for i in range(8)],
        backend=backend,
    )
    trainer.global_step = trainer.policy_version = 5
    trainer._carry_over_rollouts = [
        TrackedRollout(f"{group}-1", group, {}, enqueued_step=0) for group in ("young", "unstarted")
    ] + [TrackedRollout(f"old-{i}", "old", {}, enqueued_step=0) for i in (1, 2)]
    assert asyncio.run(trainer._apply_staleness_cap()) == 2
    assert sorted(backend.aborted) == ["old-1", "old-2"]
    assert sorted(r.data_id for r in trainer._carry_over_rollouts) == ["unstarted", "young"]


def _run(partial: bool) -> tuple[Simulation, list[dict[str, Any]]]:
    overrides = PARTIAL if partial else []
    scenario = Scenario(
        LogNormal(median=1.0, sigma=1.0), batch_size=4, n=2, steps=6, update_seconds=1.0, drain_seconds=2.0,
        overrides=tuple(overrides),
    )  # fmt: skip
    sim = Simulation(scenario, window=8)
    return sim, sim.run().history


def test_an_update_neither_pauses_nor_drains_and_rollouts_go_on_during_it() -> None:
    drained, drain_history = _run(partial=False)
    partial, partial_history = _run(partial=True)
    assert len(drained.gateway.announced_pauses) == 6  # the seed's pause at every update
    assert all(
        row["training/async/proxy_drain_seconds"] > 0
        for row in drain_history
        if row["training/async/proxy_inflight_at_pause"]
    )
    assert partial.gateway.announced_pauses == []  # never paused: nothing refused, nothing held
    assert all(row["training/async/proxy_drain_seconds"] == 0 for row in partial_history)
    # Rollouts kept running through the updates: the same updates in less (virtual) time.
    assert sum(r["timing/step_s"] for r in partial_history) < sum(r["timing/step_s"] for r in drain_history)
