"""The one place three keys become the loss an update computes.

verl spreads the choice over two sections: `actor_rollout_ref.actor.policy_loss.loss_mode` names
the policy-gradient loss (verl's `compute_policy_loss_<mode>`; Agent Lightning adds
`per_rollout_mean`, vanilla's loss under its own aggregation), `actor.loss_agg_mode` the
aggregation, and in bypass mode `algorithm.rollout_correction.loss_type` replaces the loss with
PPO-clip or REINFORCE. `resolve_loss` turns them into one `LossChoice` (the README's table is this
function), refuses the combinations that cannot mean anything, and says in one line when a key
applies to fewer terms than it seems to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollover.config.actor_rollout_ref import LossAggMode, PolicyLossMode
from rollover.config.algorithm import CorrectionLossType

# The per-token policy-gradient losses (`rollover.training.loss.pg` keys one function on each).
PgLoss = Literal["ppo_clip", "reinforce", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"]
# How the policy-gradient term is reduced: a loss_agg_mode, or Agent Lightning's per-rollout mean.
PgAggregation = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per_rollout_mean"
]

DEFAULT_LOSS_AGG_MODE: LossAggMode = "token-mean"
# The losses verl aggregates its own way, whatever loss_agg_mode says (sequence-level losses:
# each sequence weighs the same; geo_mean is one value per sequence, spread over its tokens).
OWN_AGGREGATION: dict[str, PgAggregation] = {
    "gspo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "geo_mean": "seq-mean-token-mean",
    "per_rollout_mean": "per_rollout_mean",
}
# The loss modes whose loss is PPO-clip, or REINFORCE with loss_type=reinforce.
CLIP_OR_REINFORCE: frozenset[str] = frozenset({"vanilla", "per_rollout_mean"})


@dataclass(frozen=True)
class LossChoice:
    """What one update optimises: `pg_loss` per token, reduced by `pg_aggregation`; the entropy
    bonus and the KL loss reduced by `term_aggregation`; `note` is the line that says so when
    `loss_agg_mode` was set and does not reach the policy-gradient term (None otherwise)."""

    pg_loss: PgLoss
    pg_aggregation: PgAggregation
    term_aggregation: LossAggMode
    note: str | None = None


def resolve_loss(
    loss_mode: PolicyLossMode, loss_agg_mode: LossAggMode, loss_type: CorrectionLossType, bypass_mode: bool
) -> LossChoice:
    """The loss of `actor.policy_loss.loss_mode`, `actor.loss_agg_mode`,
    `algorithm.rollout_correction.loss_type` and `bypass_mode`; raises `ValueError` naming the
    keys of a combination that means nothing."""
    mode_key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    if loss_mode in CLIP_OR_REINFORCE:
        pg_loss: PgLoss = loss_type
    elif bypass_mode:
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true takes the policy loss from "
            f"algorithm.rollout_correction.loss_type (verl's bypass_mode loss), so {mode_key}={loss_mode} cannot "
            "apply: set it to vanilla or per_rollout_mean, or bypass_mode=false"
        )
    elif loss_type == "reinforce":
        raise ValueError(
            f"algorithm.rollout_correction.loss_type=reinforce makes the vanilla and per_rollout_mean losses "
            f"REINFORCE; {mode_key}={loss_mode} is a loss of its own: set loss_type=ppo_clip or loss_mode=vanilla"
        )
    else:
        pg_loss = loss_mode  # type: ignore[assignment]  # the other modes name their own loss
    aggregation: PgAggregation = OWN_AGGREGATION.get(loss_mode, loss_agg_mode)
    note = None
    if aggregation != loss_agg_mode and loss_agg_mode != DEFAULT_LOSS_AGG_MODE:
        note = (
            f"{mode_key}={loss_mode} reduces the policy-gradient term {aggregation}; "
            f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode} applies to the entropy and KL loss terms only"
        )
    return LossChoice(pg_loss, aggregation, loss_agg_mode, note)
