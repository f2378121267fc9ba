"""One loss selection: `loss_mode`, `loss_agg_mode`, `loss_type` and `bypass_mode` resolve into
one `LossChoice` (the README's table), refusals name the keys, and one line says when
`loss_agg_mode` does not reach the policy-gradient term."""

from __future__ import annotations

import logging

import pytest

from rollover.config import ConfigError, load_config
from rollover.config.loss_choice import LossChoice, resolve_loss

MODE, AGG = "actor_rollout_ref.actor.policy_loss.loss_mode", "actor_rollout_ref.actor.loss_agg_mode"
TYPE, BYPASS = "algorithm.rollout_correction.loss_type", "algorithm.rollout_correction.bypass_mode"

# (loss_mode, loss_agg_mode, loss_type, bypass) -> (pg loss, pg aggregation); the entropy and
# KL terms always take loss_agg_mode.
TABLE = [
    ("vanilla", "token-mean", "ppo_clip", False, "ppo_clip", "token-mean"),
    ("vanilla", "seq-mean-token-sum", "ppo_clip", True, "ppo_clip", "seq-mean-token-sum"),
    ("vanilla", "token-mean", "reinforce", True, "reinforce", "token-mean"),
    ("vanilla", "token-mean", "reinforce", False, "reinforce", "token-mean"),
    ("per_rollout_mean", "token-mean", "ppo_clip", False, "ppo_clip", "per_rollout_mean"),
    ("per_rollout_mean", "seq-mean-token-mean", "reinforce", True, "reinforce", "per_rollout_mean"),
    ("gspo", "token-mean", "ppo_clip", False, "gspo", "seq-mean-token-mean"),
    ("sapo", "token-mean", "ppo_clip", False, "sapo", "seq-mean-token-mean"),
    ("geo_mean", "token-mean", "ppo_clip", False, "geo_mean", "seq-mean-token-mean"),
    ("cispo", "seq-mean-token-sum", "ppo_clip", False, "cispo", "seq-mean-token-sum"),
    ("gpg", "token-mean", "ppo_clip", False, "gpg", "token-mean"),
    ("clip_cov", "token-mean", "ppo_clip", False, "clip_cov", "token-mean"),
    ("kl_cov", "seq-mean-token-sum-norm", "ppo_clip", False, "kl_cov", "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize(("mode", "agg", "loss_type", "bypass", "pg", "aggregation"), TABLE)
def test_the_three_keys_resolve_into_one_loss(mode, agg, loss_type, bypass, pg, aggregation) -> None:
    config = load_config(
        None, [f"{MODE}={mode}", f"{AGG}={agg}", f"{TYPE}={loss_type}", f"{BYPASS}={str(bypass).lower()}"]
    )
    assert config.loss.pg_loss == pg and config.loss.pg_aggregation == aggregation
    assert config.loss.term_aggregation == agg


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        ([f"{MODE}=gspo", f"{BYPASS}=true"], [BYPASS, MODE, "loss_type"]),
        ([f"{MODE}=cispo", f"{TYPE}=reinforce"], [TYPE, MODE]),
        (
            [f"{BYPASS}=true", f"{TYPE}=reinforce", "algorithm.rollout_correction.rollout_is_batch_normalize=true"],
            ["rollout_is_batch_normalize", "bypass_mode"],
        ),
    ],
)
def test_combinations_that_mean_nothing_are_refused_naming_the_keys(overrides, keys) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, overrides)
    message = str(excinfo.value)
    assert all(key in message for key in keys) and "\n" not in message


def test_per_rollout_mean_with_another_aggregation_says_which_applies_where(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rollover.config"):
        load_config(None, [f"{MODE}=per_rollout_mean", f"{AGG}=seq-mean-token-mean"])
    lines = [r.getMessage() for r in caplog.records if "loss_agg_mode" in r.getMessage()]
    assert len(lines) == 1
    assert "per_rollout_mean" in lines[0] and "seq-mean-token-mean" in lines[0]
    assert "entropy and KL" in lines[0] and "policy-gradient" in lines[0]


@pytest.mark.parametrize(
    "overrides", [[f"{MODE}=per_rollout_mean"], [f"{MODE}=vanilla", f"{AGG}=seq-mean-token-mean"], [f"{MODE}=gspo"]]
)
def test_no_line_when_every_key_applies_as_set(overrides, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rollover.config"):
        load_config(None, overrides)
    assert not [r for r in caplog.records if "loss_agg_mode" in r.getMessage()]


def test_the_default_is_agent_lightnings() -> None:
    assert load_config().loss == LossChoice("ppo_clip", "per_rollout_mean", "token-mean")
    assert resolve_loss("vanilla", "token-mean", "ppo_clip", False) == LossChoice(
        "ppo_clip", "token-mean", "token-mean"
    )
