"""Several policies in one run (`agentlightning.policies`): one LoRA adapter per policy over the
shared base, each trained only on its own samples at its own learning rate, its advantages
normalised within its own groups, saved and merged one policy at a time."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from rollover import adapter_folder
from rollover.cli.main import main
from rollover.config import ConfigError, load_config
from rollover.training import lora
from rollover.training.actor import Actor
from rollover.training.prepare import prepare_update
from rollover.training.samples import RolloutScore, UpdateBatch
from rollover.training.update_settings import ActorSettings
from tests.training.test_lora import BASE, LORA, base_model, batch, logprobs, model_dir

__all__ = ["model_dir"]  # the tiny policy folder, shared with test_lora

pytestmark = pytest.mark.slow  # a tokenizer and several policies built, ~10 s a test on 2 cores

POLICIES = [
    *LORA,
    "agentlightning.policies={planner: {lr: 0.05}, solver: {lr: 0.01}}",
    "actor_rollout_ref.rollout.max_loras=2",
]


def two_role_batch() -> UpdateBatch:
    """`batch()`'s four samples, group g0's the planner's and g1's the solver's (each group's
    rewards are 0 and 1)."""
    base = batch()
    policies = ["planner", "planner", "solver", "solver"]
    samples = [replace(s, policy=name) for s, name in zip(base.samples, policies)]
    return UpdateBatch(samples, base.rollouts)


def adapter_weights(policy: Actor, name: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if f".{name}." in n}


def policy_logprobs(policy: Actor, name: str, ids: list[int]) -> torch.Tensor:
    lora.activate(policy.model, name)
    return logprobs(policy.model, ids)


def test_each_adapter_moves_only_on_its_own_samples(model_dir):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    groups = [{id(p) for p in g["params"]} for g in policy.optimizer.param_groups]
    assert len(groups) == 2 and len(groups[0]) == len(groups[1]) > 0 and not groups[0] & groups[1]
    planner, solver = adapter_weights(policy, "planner"), adapter_weights(policy, "solver")
    only_planner = UpdateBatch([s for s in two_role_batch().samples if s.policy == "planner"], batch().rollouts)
    metrics = policy.update(only_planner, random.Random(0), lr=5e-2)
    after_planner, after_solver = adapter_weights(policy, "planner"), adapter_weights(policy, "solver")
    assert any(not torch.equal(planner[n], after_planner[n]) for n in planner), "the planner did not move"
    assert all(torch.equal(solver[n], after_solver[n]) for n in solver), "the solver moved on the planner's samples"
    assert metrics["policy/planner/n_samples"] == 2 and "policy/solver/actor/pg_loss" not in metrics
    assert "policy/planner/actor/pg_loss" in metrics and metrics["actor/lr"] == 5e-2


def test_every_optimizer_step_is_one_policys_and_each_has_its_lr(model_dir):
    config = load_config(None, [*BASE, *POLICIES, "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    policy = Actor.load(model_dir, ActorSettings.from_config(config))
    plan = policy.plan(two_role_batch(), random.Random(0), lr=5e-2)
    assert plan.steps and all(len({plan.samples[i].policy for i in step}) == 1 for step in plan.steps)
    assert {plan.samples[step[0]].policy for step in plan.steps} == {"planner", "solver"}
    metrics = policy.run_update(plan)
    # The actor's lr is 5e-2: the planner's (5e-2) at 1x, the solver's (1e-2) at 0.2x of the step's lr.
    assert [g["lr"] for g in policy.optimizer.param_groups] == pytest.approx([5e-2, 1e-2])
    assert metrics["policy/planner/actor/grad_norm"] > 0 and metrics["policy/solver/actor/grad_norm"] > 0


def test_pi_old_goes_through_each_samples_own_adapter(model_dir):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    policy.update(two_role_batch(), random.Random(0), lr=5e-2)  # both adapters now differ from the base
    samples = two_role_batch().samples
    old = [r.old for r in policy.recompute(samples)]
    for sample, computed in zip(samples, old):
        assert sample.policy is not None
        own = policy_logprobs(policy, sample.policy, sample.input_ids)
        other = policy_logprobs(policy, "solver" if sample.policy == "planner" else "planner", sample.input_ids)
        assert torch.allclose(computed, own, atol=1e-5)
        assert not torch.allclose(computed, other, atol=1e-4)


def test_advantages_are_normalised_within_group_and_policy(model_dir):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    # Group g0: rollouts r0 (reward 0) and r1 (reward 1), each with a planner and a solver sample.
    base = two_role_batch().samples[0]
    samples = [
        replace(base, rollout_id=rid, group_id="g0", reward=reward, policy=name)
        for rid, reward in (("r0", 0.0), ("r1", 1.0))
        for name in ("planner", "solver")
    ]
    # A third rollout with the solver alone: it counts in the solver's group, not the planner's.
    samples.append(replace(base, rollout_id="r2", group_id="g0", reward=1.0, policy="solver"))
    rollouts = [RolloutScore(r, "g0", w) for r, w in (("r0", 0.0), ("r1", 1.0), ("r2", 1.0))]
    plan = policy.plan(UpdateBatch(samples, rollouts), random.Random(0), lr=1e-3)
    prepared = prepare_update(
        plan.samples,
        plan.rollouts,
        policy.recompute(plan.samples),
        policy.settings.update,
        policies=("planner", "solver"),
    )
    metrics = prepared.metrics
    advantage = {(p.unit.rollout_id, p.unit.policy): float(p.advantages[p.trained > 0][0]) for p in prepared.rows}
    # The planner's group is {0, 1}: ±1/std; the solver's is {0, 1, 1}: mean 2/3.
    assert advantage["r0", "planner"] == pytest.approx(-advantage["r1", "planner"])
    assert advantage["r1", "solver"] == pytest.approx(advantage["r2", "solver"])
    assert advantage["r1", "solver"] > 0
    assert advantage["r1", "solver"] != pytest.approx(advantage["r1", "planner"])
    assert metrics["policy/planner/reward_mean"] == pytest.approx(0.5)
    assert metrics["policy/solver/reward_mean"] == pytest.approx(2 / 3)


def test_samples_of_no_policy_are_dropped_and_counted(model_dir):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    samples = [replace(s, policy=None) if i == 0 else s for i, s in enumerate(two_role_batch().samples)]
    plan = policy.plan(UpdateBatch(samples, batch().rollouts), random.Random(0), lr=1e-3)
    assert len(plan.samples) == 3 and plan.metrics["training/n_sample_dropped/no_policy"] == 1


def test_save_checkpoint_and_merge_one_policy(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    policy.update(two_role_batch(), random.Random(0), lr=5e-2)
    saved = policy.save(tmp_path / "step_1" / "model")
    assert set(adapter_folder.policy_adapters(saved)) == {"planner", "solver"}
    ids = batch().samples[1].input_ids
    # Each saved adapter is its policy as trained.
    from peft import PeftModel

    for name in ("planner", "solver"):
        loaded = PeftModel.from_pretrained(base_model(model_dir), str(saved / name)).eval()
        assert torch.allclose(logprobs(loaded, ids), policy_logprobs(policy, name, ids), atol=1e-5)
    # `rollover model merge` takes one policy at a time and says which there are.
    assert main(["model", "merge", str(tmp_path / "step_1"), "--out", str(tmp_path / "none")]) == 2
    assert main(["model", "merge", str(tmp_path / "step_1"), "--policy", "critic", "--out", str(tmp_path / "x")]) == 2
    assert main(["model", "merge", str(tmp_path / "step_1"), "--policy", "solver", "--out", str(tmp_path / "m")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert torch.allclose(logprobs(merged, ids), policy_logprobs(policy, "solver", ids), atol=1e-5)
    # The checkpoint holds both adapters and their Adam state, even of a policy that has not
    # stepped yet (a planner-only update: the solver has none).
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    only_planner = UpdateBatch([s for s in two_role_batch().samples if s.policy == "planner"], batch().rollouts)
    policy.update(only_planner, random.Random(0), lr=5e-2)
    policy.save_training_state(tmp_path / "state")
    resumed = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *POLICIES])))
    resumed.load_training_state(tmp_path / "state")
    for name in ("planner", "solver"):
        assert all(
            torch.equal(a, b)
            for a, b in zip(adapter_weights(policy, name).values(), adapter_weights(resumed, name).values())
        )
    n_parameters = sum(len(g["params"]) for g in policy.optimizer.param_groups)
    saved_moments = [s["exp_avg"] for s in policy.optimizer.state.values()]
    loaded_moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]
    assert len(saved_moments) == len(loaded_moments) == n_parameters
    assert all(torch.equal(a, b) for a, b in zip(saved_moments, loaded_moments))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agentlightning.policies={a: {}, b: {}}"], r"agentlightning\.policies needs .*lora_rank > 0"),
        ([*LORA, "agentlightning.policies={a: {}, b: {}}"], r"max_loras=1 is fewer than the 2 policies"),
        ([*LORA, "agentlightning.policies={a-b: {}}"], r"agentlightning\.policies.*must start with a letter"),
        (
            [*LORA, "agentlightning.policies={a: {}}", "actor_rollout_ref.model.lora_adapter_path=/x"],
            r"lora_adapter_path starts one adapter",
        ),
        (["agentlightning.policies={a:{}}"], r"'agentlightning\.policies'.*not YAML"),
    ],
)
def test_bad_policy_configs_are_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_one_policy_runs_keep_the_single_adapter_layout(model_dir, tmp_path):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *LORA])))
    assert policy.settings.policies == () and len(policy.optimizer.param_groups) == 1
    saved = policy.save(tmp_path / "model")
    assert adapter_folder.is_adapter(saved) and adapter_folder.policy_adapters(saved) == {}
    assert main(["model", "merge", str(saved), "--policy", "x", "--out", str(tmp_path / "m")]) == 2
