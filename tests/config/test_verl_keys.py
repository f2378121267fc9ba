"""verl's keys mean verl's things: defaults that follow other keys, refusals that name the key,
and the run-length and evaluation keys."""

from __future__ import annotations

from typing import get_args

import pytest

from rollover.config import ConfigError, GatewaySettings, load_config
from rollover.config.actor_rollout_ref import KLType, LossAggMode, ScheduleKind
from rollover.config.algorithm import RolloutIsMode
from rollover.config.loss_choice import PgLoss
from rollover.config.no_effect import NO_EFFECT, no_effect_notes
from rollover.training.loss.aggregate import AGGREGATIONS
from rollover.training.loss.correction import IS_MODES
from rollover.training.loss.kl import KL_ESTIMATORS
from rollover.training.loss.pg import PG_LOSSES
from rollover.training.schedule import SCHEDULES


def test_every_closed_set_of_names_has_one_function_per_name():
    assert set(get_args(LossAggMode)) == set(AGGREGATIONS)
    assert set(get_args(PgLoss)) == set(PG_LOSSES)
    assert set(get_args(RolloutIsMode)) == set(IS_MODES)
    assert set(get_args(ScheduleKind)) == set(SCHEDULES)
    assert {name.rstrip("+") for name in get_args(KLType)} == set(KL_ESTIMATORS)


def test_the_clip_bounds_default_to_clip_ratio():
    actor = load_config(None, ["actor_rollout_ref.actor.clip_ratio=0.25"]).actor_rollout_ref.actor
    assert (actor.clip_low, actor.clip_high) == (0.25, 0.25)
    actor = load_config(None, ["actor_rollout_ref.actor.clip_ratio_high=0.28"]).actor_rollout_ref.actor
    assert (actor.clip_low, actor.clip_high) == (0.2, 0.28)


def test_a_rollout_engine_other_than_vllm_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.name.*vLLM") as excinfo:
        load_config(None, ["actor_rollout_ref.rollout.name=sglang"])
    assert "\n" not in str(excinfo.value)


def test_greedy_validation_forces_temperature_zero():
    config = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.temperature=0.7"])
    assert GatewaySettings.from_config(config).val_temperature == 0.7
    greedy = load_config(
        None,
        [
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        ],
    )
    assert GatewaySettings.from_config(greedy).val_temperature == 0.0


def test_a_config_that_gives_only_total_epochs_runs_for_epochs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_epochs: 3\ndata:\n  train_batch_size: 4\n")
    from rollover.training.settings import TrainerSettings

    config = load_config(path)
    assert config.trainer.total_training_steps is None
    assert TrainerSettings.from_config(config).total_steps(n_train_tasks=10) == 9
    both = TrainerSettings.from_config(load_config(path, ["trainer.total_training_steps=5"]))
    assert both.total_steps(n_train_tasks=10) == 5  # verl: total_training_steps wins
    assert TrainerSettings.from_config(load_config()).total_steps(n_train_tasks=10) == 10  # Rollover's default


def test_save_freq_minus_one_means_no_checkpoints():
    from rollover.training.settings import TrainerSettings
    from rollover.training.trainer import Trainer

    for freq, due in ((-1, [False, False]), (0, [False, True]), (2, [True, True])):
        config = load_config(None, [f"trainer.save_freq={freq}"])
        trainer = Trainer(
            settings=TrainerSettings.from_config(config),
            client=None,
            actor=None,
            weight_sync=None,
            train_tasks=[{}],
            run_dir="r",
        )  # type: ignore[arg-type]
        trainer.global_step = 2
        assert [trainer._checkpoint_due(last) for last in (False, True)] == due, freq


def test_rejection_bounds_default_to_the_is_threshold_and_its_reciprocal():
    correction = load_config(None, ["algorithm.rollout_correction.rollout_rs=token"]).algorithm.rollout_correction
    assert correction.rejection_bounds == (0.5, 2.0)
    with pytest.raises(ConfigError, match="rollout_rs_threshold_lower"):
        load_config(
            None,
            [
                "algorithm.rollout_correction.rollout_rs=token",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
                "algorithm.rollout_correction.rollout_rs_threshold_lower=3",
            ],
        )


def test_a_reference_is_needed_only_for_a_kl_term():
    assert not load_config().needs_reference
    assert load_config(None, ["actor_rollout_ref.actor.use_kl_loss=true"]).needs_reference
    assert load_config(None, ["algorithm.use_kl_in_reward=true"]).needs_reference


def test_the_per_gpu_micro_batch_spellings_win():
    config = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=8",
            "trainer.n_gpus_per_node=2",
        ],
    )
    assert config.actor_rollout_ref.actor.micro_batch_size == 2
    assert config.ref_logprob_micro_batch_size == 4  # verl's global size over the ranks
    assert config.old_logprob_micro_batch_size == 2  # null: the actor's


@pytest.mark.parametrize("entry", NO_EFFECT, ids=lambda e: e.key)
def test_every_declared_no_effect_key_warns_one_line_naming_it_and_only_when_set(entry, caplog):
    values = {
        "agentlightning.hooks": "hooks.py",
        "actor_rollout_ref.rollout.mode": "sync",
        "actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "2",
        "trainer.critic_warmup": "1",
        "algorithm.rollout_correction.rollout_is": "token",
    }
    # the keys that only mean nothing beside another
    beside = {"algorithm.rollout_correction.rollout_is": ["algorithm.rollout_correction.bypass_mode=true"]}
    assert not any(entry.key in note for note in no_effect_notes(load_config(None, beside.get(entry.key, []))))
    with caplog.at_level("WARNING", logger="rollover.config"):
        load_config(None, [f"{entry.key}={values.get(entry.key, 'true')}", *beside.get(entry.key, [])])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"'{entry.key}'" in lines[0] and "no effect" in lines[0]
