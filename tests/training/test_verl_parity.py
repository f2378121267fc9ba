"""Issue 32's seven differences from verl, each pinned to its worked example: the five fixed
take verl's value, the one kept (seq-mean-token-sum-norm) takes Dr. GRPO's with verl's beside
it. And verl HEAD's rejection spellings, with HEAD's meaning (each token's log-ratio clamped
before a sequence's sum)."""

from __future__ import annotations

import math

import pytest
import torch

from rollover.config import ConfigError, load_config
from rollover.config.algorithm import RejectionCriterion
from rollover.training.advantages import Unit
from rollover.training.loss.aggregate import BatchCounts, aggregate
from rollover.training.loss.correction import importance_weights, rejection_mask
from rollover.training.loss.pg import ppo_clip
from rollover.training.objective import Forward, micro_batch_objective
from rollover.training.prepare import PreparedSample, correct
from rollover.training.samples import Sample
from rollover.training.update_settings import ClipRange, UpdateSettings


def _pair(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_old, log μ) whose per-token log-ratios are `log_ratios`."""
    behaviour = torch.full((len(log_ratios), len(log_ratios[0])), -1.0)
    return behaviour + torch.tensor(log_ratios), behaviour


def test_1_seq_mean_token_sum_norm_keeps_dr_grpos_mean_over_sequences() -> None:
    """Deliberate deviation (README): ones[2, 3], all masked, loss_scale_factor 4 -> verl's
    agg_loss gives Σ token sums / 4 = 1.5; Dr. GRPO's paper (and Rollover) also divide by the
    2 sequences: 0.75, the same value however the mini-batch is split."""
    values, mask = torch.ones(2, 3), torch.ones(2, 3)
    ours = aggregate(values, mask, "seq-mean-token-sum-norm", BatchCounts(6, 2, 4))
    assert ours.item() == pytest.approx(0.75)
    assert ours.item() * 2 == pytest.approx(1.5)  # verl's value: no mean over the sequences


def test_2_is_weights_and_kl_count_the_tokens_rejection_drops() -> None:
    """mask [[1, 1]], log-ratio [ln 8, ln 1.5], token rejection at 4, sequence IS at 2: the
    kept token's weight is min(8 · 1.5, 2) = 2.0 and kl -(ln 8 + ln 1.5)/2 = -1.242, as verl
    (Rollover used to give 1.5 and -0.405, from the kept token alone)."""
    settings = UpdateSettings.from_config(
        load_config(
            None,
            [
                "algorithm.rollout_correction.rollout_is=sequence",
                "algorithm.rollout_correction.rollout_is_threshold=2.0",
                "algorithm.rollout_correction.rollout_rs=token",
                "algorithm.rollout_correction.rollout_rs_threshold=4.0",
            ],
        )
    )
    sample = Sample("r", "g", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [0, 0, 0], 1.0)
    old = torch.tensor([-1.0 + math.log(8.0), -1.0 + math.log(1.5)])
    trained, weights, metrics = correct([sample], [torch.tensor([1.0, 1.0])], [old], settings)
    assert trained[0].tolist() == [0.0, 1.0]
    assert weights[0] is not None and weights[0][1].item() == pytest.approx(2.0)
    assert metrics["rollout_corr/kl"] == pytest.approx(-(math.log(8.0) + math.log(1.5)) / 2, abs=1e-5)
    assert metrics["rollout_corr/kl"] == pytest.approx(-1.242, abs=1e-3)


def test_3_sequence_batch_normalisation_divides_by_the_mean_over_sequences() -> None:
    """mask [[1, 1, 1], [1, 0, 0]], sequence weights 1.5 and 0.5: their mean over sequences is
    1, so they stay 1.5 and 0.5 (verl); the token-weighted mean 1.25 gave 1.2 and 0.4."""
    old, behaviour = _pair([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    weights, metrics = importance_weights(old, behaviour, mask, "sequence", 2.0, batch_normalize=True)
    assert weights[0, 0].item() == pytest.approx(1.5) and weights[1, 0].item() == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.0)


def test_4_sequence_means_weigh_each_row_by_its_tokens() -> None:
    """The same rows: rollout_is_mean (sequence IS) and rollout_rs_mean (sequence and geometric
    rejection) are token means, (1.5·3 + 0.5·1)/4 = 1.25, not the row mean 1.0."""
    old, behaviour = _pair([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    _, metrics = importance_weights(old, behaviour, mask, "sequence", 2.0)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.25)
    for mode, expected in (("sequence", 1.25), ("geometric", (3 * 1.5 ** (1 / 3) + 0.5) / 4)):
        _, rs = rejection_mask(old, behaviour, mask, [RejectionCriterion(mode, 0.1, 10.0)])  # type: ignore[arg-type]
        assert rs["rollout_corr/rollout_rs_mean"] == pytest.approx(expected, rel=1e-5), mode


def test_5_ppo_kl_is_clamped_at_20() -> None:
    new = torch.tensor([[30.0, -30.0, 0.5]])
    terms = ppo_clip(
        _inputs(new, torch.zeros(1, 3)),
        ClipRange(),
    )
    assert terms.kl[0].tolist() == pytest.approx([-20.0, 20.0, -0.5])


def _inputs(new: torch.Tensor, old: torch.Tensor):  # type: ignore[no-untyped-def]
    from rollover.training.loss.pg import PgInputs

    return PgInputs(new, old, torch.ones_like(new), torch.ones_like(new))


def test_6_bypass_rejection_metrics_divide_by_the_tokens_kept() -> None:
    """Bypass mode, 22 trained tokens, 3 rejected (μ far from π_θ): pg_clipfrac, ppo_kl and
    entropy are means over the 19 kept (1/19 each), not over the 22."""
    settings = UpdateSettings.from_config(
        load_config(
            None,
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.rollout_rs=token",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            ],
        )
    )
    width = 22
    logprobs = torch.full((1, width), -1.0, requires_grad=True)
    mu = torch.full((width,), -1.0)
    mu[:3] = -5.0  # π_θ/μ = e^4 > 2: rejected
    entropy = torch.arange(width, dtype=torch.float32).unsqueeze(0)
    row = PreparedSample(
        Sample("r", "g", list(range(width + 1)), [0] + [1] * width, [0.0] * (width + 1), [0] * (width + 1), 1.0),
        Unit("r"),
        old=mu,
        advantages=torch.ones(width),
        trained=torch.ones(width),
    )
    objective = micro_batch_objective(Forward(logprobs, entropy), [row], BatchCounts(width, 1, 1), settings)
    total, count = objective.means["actor/entropy"]
    assert count == 19 and total / count == pytest.approx(sum(range(3, 22)) / 19)
    assert objective.means["actor/pg_clipfrac"][1] == 19 and objective.means["actor/ppo_kl"][1] == 19
    assert objective.means["rollout_corr/rollout_rs_masked_fraction"] == (3.0, 22.0)


def test_7_rejection_fractions_are_reported_before_the_veto() -> None:
    """A veto drops row 1 (a token ratio 0.01 < 0.05); the ratio bounds [0.5, 2] drop nothing:
    rollout_rs_masked_fraction and rollout_rs_seq_masked_fraction stay 0, as verl reports them."""
    old, behaviour = _pair([[0.0, 0.0], [math.log(0.01), 0.0]])
    keep, metrics = rejection_mask(
        old, behaviour, torch.ones(2, 2), [RejectionCriterion("geometric", 0.01, 100.0)], 0.05
    )
    assert keep.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(0.5)


# ---------------------------------------------------------------- verl HEAD's spellings


def _head(rs: str, threshold: str) -> tuple[RejectionCriterion, ...]:
    config = load_config(
        None,
        [
            f"algorithm.rollout_correction.rollout_rs={rs}",
            f"algorithm.rollout_correction.rollout_rs_threshold={threshold}",
        ],
    )
    return config.algorithm.rollout_correction.rejection_criteria()


def test_head_spellings_parse_with_heads_bounds() -> None:
    assert _head("token_k1", "0.5_2.0") == (RejectionCriterion("token_k1", 0.5, 2.0),)
    assert _head("token_k1", "2.0") == (RejectionCriterion("token_k1", 0.5, 2.0),)  # one bound: its reciprocal below
    assert _head("seq_mean_k3", "0.01") == (RejectionCriterion("seq_mean_k3", None, 0.01),)
    both = _head("'token_k1,seq_max_k2'", "'0.25_4,0.5'")
    assert both == (RejectionCriterion("token_k1", 0.25, 4.0), RejectionCriterion("seq_max_k2", None, 0.5))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.rollout_correction.rollout_rs=token_k4"], "unknown"),
        (["algorithm.rollout_correction.rollout_rs=seq_sum_k2"], "must be given"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2",
                "algorithm.rollout_correction.rollout_rs_threshold='0.1_1'",
            ],
            "single upper bound",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
                "algorithm.rollout_correction.rollout_token_veto_threshold=0.1",
            ],
            "before 2026",
        ),
    ],
)
def test_head_spellings_refuse_what_head_refuses(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_head_token_estimators_by_hand() -> None:
    """Token log-ratios x = [ln 3, 0, -0.5]: k1 = -x keeps [ln 0.5, ln 2] -> tokens 1, 2 (x = ln 3
    gives k1 = -1.10 < ln 0.5 = -0.69); k2 = x²/2 ≤ 0.1 keeps token 1 (0.60, 0, 0.125);
    k3 = eˣ - 1 - x ≤ 0.2 keeps tokens 1 and 2 (0.90, 0, 0.107)."""
    old, behaviour = _pair([[math.log(3.0), 0.0, -0.5]])
    mask = torch.ones(1, 3)
    k1, m1 = rejection_mask(old, behaviour, mask, [RejectionCriterion("token_k1", 0.5, 2.0)])
    assert k1.tolist() == [[0.0, 1.0, 1.0]]
    assert m1["rollout_corr/rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 3)
    assert m1["rollout_corr/rollout_rs_token_k1_mean"] == pytest.approx(-(math.log(3.0) - 0.5) / 3, abs=1e-6)
    k2, _ = rejection_mask(old, behaviour, mask, [RejectionCriterion("token_k2", None, 0.1)])
    assert k2.tolist() == [[0.0, 1.0, 0.0]]
    k3, _ = rejection_mask(old, behaviour, mask, [RejectionCriterion("token_k3", None, 0.2)])
    assert k3.tolist() == [[0.0, 1.0, 1.0]]


def test_head_clamps_each_token_before_the_sum() -> None:
    """Token log-ratios [30, -15]: HEAD's seq_sum_k1 is -(clamp(30) + clamp(-15)) = -5, which
    ratio bounds [e^-10, e^10] keep; before 2026 the sequence ratio exp(clamp(15)) = e^15 is
    rejected by the same bounds."""
    old, behaviour = _pair([[30.0, -15.0]])
    mask = torch.ones(1, 2)
    bounds = (math.exp(-10.0), math.exp(10.0))
    head, metrics = rejection_mask(old, behaviour, mask, [RejectionCriterion("seq_sum_k1", *bounds)])
    assert head.tolist() == [[1.0, 1.0]] and metrics["rollout_corr/rollout_rs_seq_sum_k1_mean"] == pytest.approx(-5.0)
    legacy, _ = rejection_mask(old, behaviour, mask, [RejectionCriterion("sequence", *bounds)])
    assert legacy.tolist() == [[0.0, 0.0]]


def test_head_options_must_all_pass() -> None:
    """Row 0, x = [0, 0.3], passes both tests. Row 1, x = [0.5, ln 3]: token_k1 within [0.5, 2]
    drops its second token (k1 = -1.10 < ln 0.5), and seq_max_k2 ≤ 0.1 then drops the whole row
    (its max x²/2 is 0.60)."""
    old, behaviour = _pair([[0.0, 0.3], [0.5, math.log(3.0)]])
    criteria = [RejectionCriterion("token_k1", 0.5, 2.0), RejectionCriterion("seq_max_k2", None, 0.1)]
    keep, metrics = rejection_mask(old, behaviour, torch.ones(2, 2), criteria)
    assert keep.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 4)
    assert metrics["rollout_corr/rollout_rs_seq_max_k2_seq_masked_fraction"] == pytest.approx(1 / 2)
