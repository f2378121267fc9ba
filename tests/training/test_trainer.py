"""Trainer behaviour beyond the manager: window top-up, staleness cap, drain timeout, checkpoints."""

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest

from rollover.config import load_config
from rollover.gateway.client import GatewayClient
from rollover.metrics.progress import NullProgress
from rollover.simulate import LogNormal, Scenario, Simulation
from rollover.store.models import RolloutState
from rollover.training.drain import DrainTimeout, GatewayPause
from rollover.training.manager import TrackedRollout
from rollover.training.settings import TrainerSettings
from rollover.training.trainer import RolloutsFailing
from tests.conftest import ADMIN_KEY


def heavy_tail(steps=12, overrides=()):
    return Scenario(
        LogNormal(median=1.0, sigma=1.5), batch_size=4, n=2, steps=steps, update_seconds=0.5, overrides=tuple(overrides)
    )


def test_window_is_topped_up_to_async_train_batch_size():
    sim = Simulation(heavy_tail(), window=8)
    result = sim.run()
    for row in result.history:
        groups_in_window = (
            row["training/async/n_completed_rollouts"] + row["training/async/n_new_carry_over_rollouts"]
        ) / 2
        assert groups_in_window == 8
        assert row["training/async/n_completed_rollouts"] == 4 * 2


def test_each_pause_is_announced_as_long_as_the_last_one():
    sim = Simulation(heavy_tail(steps=4), window=8)
    history = sim.run().history
    announced = sim.gateway.announced_pauses
    assert announced[0] is None  # nothing measured yet: plain Retry-After
    for step in range(1, 4):
        measured = history[step]["timing/gateway_pause_s"]
        assert measured >= 0.5  # the pause covers the 0.5 s update
        assert announced[step] == measured


def test_staleness_cap_aborts_and_requeues_old_groups():
    cap = 1
    capped = Simulation(
        heavy_tail(overrides=[f"agentlightning.async_rollout.max_carry_over_age_steps={cap}"]), window=12
    )
    result = capped.run()
    assert result.n_aborted_stale_rollouts > 0
    # no group older than the cap (+ the step that consumes it) was ever trained on
    assert max(c.age_steps for c in capped.gateway.consumed) <= cap + 1
    stale = [r for r in capped.backend.rollouts.values() if (r.error_message or "").startswith("aborted: stale")]
    assert len(stale) == result.n_aborted_stale_rollouts
    assert all(r.state == RolloutState.FAILED for r in stale)
    uncapped = Simulation(heavy_tail(), window=12).run()
    assert uncapped.max_carry_over_age > cap + 1  # the cap is what made the difference


def test_the_trainers_settings_check_the_async_window():
    config = load_config(None, ["data.train_batch_size=4"])
    config.agentlightning.async_rollout.enabled = True  # a nested assignment skips the root validator
    with pytest.raises(ValueError, match="async_train_batch_size=None, train_batch_size=4"):
        TrainerSettings.from_config(config)


@pytest.mark.slow
def test_drain_timeout_names_the_stuck_rollouts(gateway, admin, stub):
    stub.behaviour.delay_seconds = 3.0
    admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url}])
    [rollout] = admin.post("/api/rollouts", json=[{"input": {}}]).json()
    rid = rollout["rollout_id"]
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
    url = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions"
    call = threading.Thread(
        target=lambda: httpx.post(url, json={"messages": []}, headers={"x-api-key": ADMIN_KEY}, timeout=30)
    )
    call.start()
    while admin.get("/proxy/state").json()["inflight"] == 0:
        time.sleep(0.01)

    async def drain():
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            pause = GatewayPause(
                client, partial_rollout=False, retry_after_seconds=5, drain_timeout_seconds=0.5, clock=time.monotonic
            )
            await pause.pause_and_drain(0, NullProgress())

    with pytest.raises(DrainTimeout, match=rid):
        asyncio.run(drain())
    call.join()
    state = admin.get("/proxy/state").json()
    assert state["inflight"] == 0 and state["paused"] is True


def test_a_step_without_samples_is_reported_and_leaves_the_policy_alone(caplog):
    """Every completed rollout of step 0 failed (no recorded calls): nothing to train on."""
    sim = Simulation(heavy_tail(steps=3), window=8)
    real_triplets = sim.gateway.triplets
    updates, syncs = [], []

    async def nothing_in_step_0(rollout_id, attempt_id=None):
        bundle = await real_triplets(rollout_id, attempt_id)
        if sim.trainer.global_step == 0:
            return bundle.model_copy(update={"triplets": []})
        return bundle

    real_update, real_sync = sim.trainer.actor.update, sim.trainer.weight_sync.sync
    sim.gateway.triplets = nothing_in_step_0
    sim.trainer.actor.update = lambda batch, rng, **kw: (
        updates.append(len(batch.samples)) or real_update(batch, rng, **kw)
    )

    async def counting_sync(policy, version):
        syncs.append(version)
        await real_sync(policy, version)

    sim.trainer.weight_sync.sync = counting_sync
    with caplog.at_level("WARNING", logger="rollover.trainer"):
        history = sim.run().history
    assert [row["training/update_skipped"] for row in history] == [1.0, 0.0, 0.0]
    assert history[0]["rollouts/n_samples"] == 0
    assert updates == [8, 8] and syncs == [1, 2]  # steps 1 and 2 only; versions not bumped by step 0
    assert sim.trainer.policy_version == 2 and sim.trainer.global_step == 3
    assert sum("the policy is not updated" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("limit", [3, 1, 0])
def test_a_run_whose_every_rollout_fails_stops_with_the_error(limit):
    """Every rollout fails (an agent that cannot start): the run stops after
    `trainer.max_failed_steps` such steps, naming the agents' error; 0 never stops it."""
    sim = Simulation(heavy_tail(steps=6, overrides=[f"trainer.max_failed_steps={limit}"]), window=8)
    real_settle = sim.backend._settle

    def settle(rollout, state, error):
        if state == RolloutState.SUCCEEDED:
            state, error = RolloutState.FAILED, "agent class: cannot import module 'calc_agnet'"
        real_settle(rollout, state, error)

    sim.backend._settle = settle
    if not limit:
        assert sim.run().steps == 6
        return
    with pytest.raises(RolloutsFailing, match=r"last \d+ steps failed.*cannot import module 'calc_agnet'"):
        sim.run()
    assert sim.trainer.global_step == limit - 1  # the step that stops the run is not counted


def test_only_failed_steps_in_a_row_stop_a_run():
    trainer = Simulation(heavy_tail(overrides=["trainer.max_failed_steps=2"]), window=8).trainer
    failed, ok = (TrackedRollout(f"r-{s}", "d", {}, 0, state=s) for s in (RolloutState.FAILED, RolloutState.SUCCEEDED))
    trainer._check_failing([failed], n_failed=1)
    trainer._check_failing([failed, ok], n_failed=1)  # one success is a step that worked: the count starts over
    trainer._check_failing([failed], n_failed=1)
    with pytest.raises(RolloutsFailing, match="last 2 steps"):
        trainer._check_failing([failed], n_failed=1)


def test_resuming_a_finished_run_requeues_the_carry_over_it_aborted():
    """A run aborts its carry-over after its last checkpoint. Resumed from that checkpoint (to
    train longer), those groups must be re-queued, not trained on as failures."""
    sim = Simulation(heavy_tail(steps=2), window=8)
    sim.run()
    trainer = sim.trainer
    trainer.load_state_dict(trainer.state_dict())  # what the last checkpoint holds
    aborted = {
        r.data_id
        for r in trainer._carry_over_rollouts
        if (sim.backend.rollouts[r.rollout_id].error_message or "").startswith("aborted: training finished")
    }
    assert aborted  # heavy tail: some carried groups were still running when the run finished
    trainer.settings = dataclasses.replace(trainer.settings, total_training_steps=4)
    asyncio.run(trainer.reconcile_after_restart())
    assert not aborted & {r.data_id for r in trainer._carry_over_rollouts}
    assert len(trainer.loader.requeued) == len(aborted)
    sim.gateway.consumed.clear()
    resumed = [m for m in asyncio.run(trainer.fit()) if "timing/step_s" in m][2:]
    assert [m["rollouts/n_failed"] for m in resumed] == [0, 0]
    assert all(c.state == RolloutState.SUCCEEDED for c in sim.gateway.consumed)
