import math
from typing import get_args

import pytest
import torch

from rollover.config.loss_choice import PgLoss
from rollover.training.loss.pg import PG_LOSSES, PgInputs, PgTerms, ppo_clip, reinforce
from rollover.training.update_settings import ClipRange, LossParameters


def test_every_policy_loss_has_one_function() -> None:
    assert set(get_args(PgLoss)) == set(PG_LOSSES)


def _one_token(ratio: float, advantage: float) -> PgInputs:
    old = torch.tensor([[-1.0]])
    new = (old + math.log(ratio)).requires_grad_(True)
    return PgInputs(new, old, torch.tensor([[advantage]]), torch.ones(1, 1))


# ---------------------------------------------------------------- ppo_clip

# One token per branch, ε = 0.2, c = 3:
#   t0: A= 1, r=1.1  -> -A r = -1.1, -A clip(r) = -1.1 -> l = -1.1  (unclipped)
#   t1: A= 1, r=1.5  -> -1.5 vs -1.2                    -> l = -1.2  (clipped)
#   t2: A=-1, r=0.5  ->  0.5 vs  0.8                    -> l =  0.8  (clipped; below cap 3)
#   t3: A=-1, r=5.0  ->  5.0 vs  1.2 -> 5.0, min(5, 3)  -> l =  3.0  (dual-clipped)
#   t4: A= 2, r=0.9  -> -1.8 vs -1.8                    -> l = -1.8  (unclipped)
#   t5: padding (mask 0), filled with `pad`
RATIOS = [1.1, 1.5, 0.5, 5.0, 0.9]
ADVS = [1.0, 1.0, -1.0, -1.0, 2.0]


def _branch_inputs(pad: float = 0.0, dirty: int | None = None) -> PgInputs:
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, 0.0]])
    new = old.clone()
    new[0, :5] += torch.log(torch.tensor(RATIOS))
    adv = torch.tensor([[*ADVS, 0.0]])
    tensors = [new, old, adv]
    if dirty is not None:
        tensors[dirty][0, 5] = pad
    tensors[0].requires_grad_(True)
    return PgInputs(tensors[0], tensors[1], tensors[2], torch.tensor([[1, 1, 1, 1, 1, 0]]))


def test_ppo_clip_branches_by_hand() -> None:
    inputs = _branch_inputs()
    terms = ppo_clip(inputs, ClipRange(low=0.2, high=0.2, dual_c=3.0))
    assert terms.per_token[0].tolist() == pytest.approx([-1.1, -1.2, 0.8, 3.0, -1.8, 0.0], abs=1e-6)
    assert terms.clipped[0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # t1, t2
    assert terms.clipped_lower[0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # t3
    assert (-terms.kl)[0].tolist() == pytest.approx([*(math.log(r) for r in RATIOS), 0.0], abs=1e-6)
    assert not terms.kl.requires_grad

    terms.per_token.sum().backward()
    # d(-A r)/d log π_θ = -A r on unclipped tokens, 0 on clipped and dual-clipped ones:
    # t0: -1.1, t4: -2 * 0.9 = -1.8
    assert inputs.logprobs.grad is not None
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-1.1, 0.0, 0.0, 0.0, -1.8, 0.0], abs=1e-6)


def test_clip_higher_positive_advantage_clipped_at_high_only() -> None:
    # r = 1.25, A = 1: high 0.2 -> max(-1.25, -1.2) = -1.2 (clipped); high 0.28 -> -1.25 (not)
    tight = ppo_clip(_one_token(1.25, 1.0), ClipRange(low=0.2, high=0.2))
    loose = ppo_clip(_one_token(1.25, 1.0), ClipRange(low=0.2, high=0.28))
    assert tight.per_token.item() == pytest.approx(-1.2)
    assert tight.clipped.item() == 1.0
    assert loose.per_token.item() == pytest.approx(-1.25)
    assert loose.clipped.item() == 0.0


def test_clip_higher_negative_advantage_clipped_at_low() -> None:
    # r = 0.75, A = -1: low 0.2 -> max(0.75, 0.8) = 0.8 (clipped); low 0.3 -> clip(0.75) = 0.75 (not)
    # high does not matter on this side.
    tight = ppo_clip(_one_token(0.75, -1.0), ClipRange(low=0.2, high=0.28))
    loose = ppo_clip(_one_token(0.75, -1.0), ClipRange(low=0.3, high=0.28))
    assert tight.per_token.item() == pytest.approx(0.8)
    assert tight.clipped.item() == 1.0
    assert loose.per_token.item() == pytest.approx(0.75)
    assert loose.clipped.item() == 0.0


def test_ratio_above_high_with_negative_advantage_is_not_eps_clipped() -> None:
    # r = 1.25, A = -1: max(1.25, 1.2) = 1.25: the pessimistic bound keeps the unclipped branch
    terms = ppo_clip(_one_token(1.25, -1.0), ClipRange(low=0.2, high=0.2))
    assert terms.per_token.item() == pytest.approx(1.25)
    assert terms.clipped.item() == 0.0
    assert terms.clipped_lower.item() == 0.0


def test_dual_clip_caps_negative_advantage() -> None:
    # r = 5, A = -2: l1 = 10, l2 = 2 * 1.2 = 2.4, max = 10; c = 3 caps at -c A = 6; c = 12 caps at 24
    inputs = _one_token(5.0, -2.0)
    capped = ppo_clip(inputs, ClipRange(dual_c=3.0))
    assert capped.per_token.item() == pytest.approx(6.0)
    assert capped.clipped_lower.item() == 1.0
    capped.per_token.sum().backward()
    assert inputs.logprobs.grad is not None and inputs.logprobs.grad.item() == 0.0  # a constant

    uncapped = ppo_clip(_one_token(5.0, -2.0), ClipRange(dual_c=12.0))
    assert uncapped.per_token.item() == pytest.approx(10.0)
    assert uncapped.clipped_lower.item() == 0.0


def test_dual_clip_never_applies_to_positive_advantage() -> None:
    # r = 5, A = 2: max(-10, -2.4) = -2.4 (ε-clipped); the dual cap -c A = -6 would be lower
    terms = ppo_clip(_one_token(5.0, 2.0), ClipRange(dual_c=3.0))
    assert terms.per_token.item() == pytest.approx(-2.4)
    assert terms.clipped_lower.item() == 0.0


def test_clip_range_rejects_dual_c_at_most_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ClipRange(dual_c=1.0)


def test_is_weights_multiply_per_token_loss() -> None:
    inputs = _branch_inputs()
    weights = torch.tensor([[0.5, 1.0, 1.0, 2.0, 1.0, float("nan")]])  # padding weight ignored
    weighted = PgInputs(inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, weights)
    terms = ppo_clip(weighted, ClipRange())
    # (0.5 * -1.1, -1.2, 0.8, 2 * 3.0, -1.8, 0)
    assert terms.per_token[0].tolist() == pytest.approx([-0.55, -1.2, 0.8, 6.0, -1.8, 0.0], abs=1e-6)


@pytest.mark.parametrize("loss_type", sorted(PG_LOSSES))
@pytest.mark.parametrize("dirty", [0, 1, 2])  # which input is dirty: log π_θ, log π_old, A
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -1e30])
def test_padding_never_affects_loss_or_grad(loss_type: PgLoss, dirty: int, garbage: float) -> None:
    loss_fn = PG_LOSSES[loss_type]
    clean_inputs, dirty_inputs = _branch_inputs(), _branch_inputs(garbage, dirty)
    clean, messy = loss_fn(clean_inputs, ClipRange()), loss_fn(dirty_inputs, ClipRange())
    clean.per_token.sum().backward()
    messy.per_token.sum().backward()
    for field in ("per_token", "clipped", "clipped_lower", "kl"):
        assert torch.equal(getattr(clean, field), getattr(messy, field)), field
    assert torch.equal(clean_inputs.logprobs.grad, dirty_inputs.logprobs.grad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- reinforce


def test_reinforce_by_hand() -> None:
    # l = -A log π_θ w:  t00: -(1)(-1)(0.5) = 0.5;  t01: -(1)(-2)(1) = 2;  t10: -(-2)(-0.5)(2) = -2
    # d l / d log π_θ = -A w: -0.5, -1, 4;  t11 is padding
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.25, 0.0]])
    inputs = PgInputs(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=torch.tensor([[1.0, 1.0], [-2.0, 5.0]]),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        is_weights=torch.tensor([[0.5, 1.0], [2.0, 3.0]]),
    )
    terms = reinforce(inputs, ClipRange())
    assert terms.per_token.tolist() == [pytest.approx([0.5, 2.0]), pytest.approx([-2.0, 0.0])]
    assert terms.clipped.sum().item() == 0.0 and terms.clipped_lower.sum().item() == 0.0
    # log π_θ - log π_old: 0.5, 0, -0.25, (padding) 0
    assert (-terms.kl).tolist() == [pytest.approx([0.5, 0.0]), pytest.approx([-0.25, 0.0])]
    terms.per_token.sum().backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == [pytest.approx([-0.5, -1.0]), pytest.approx([4.0, 0.0])]


def test_reinforce_without_weights_is_minus_advantage_times_logprob() -> None:
    inputs = PgInputs(torch.tensor([[-2.0]]), torch.tensor([[-1.0]]), torch.tensor([[3.0]]), torch.ones(1, 1))
    terms: PgTerms = reinforce(inputs, ClipRange())
    assert terms.per_token.item() == pytest.approx(6.0)  # -(3)(-2)


# ---------------------------------------------------------------- verl's other losses


def _tokens(ratios: list[float], advantages: list[float], logprobs: list[float] | None = None, **extra) -> PgInputs:
    """One row: π_θ/π_old = `ratios` per token (log π_θ = `logprobs`, default -1)."""
    new = torch.tensor([logprobs or [-1.0] * len(ratios)], requires_grad=True)
    old = new.detach() - torch.log(torch.tensor([ratios]))
    return PgInputs(new, old, torch.tensor([advantages]), torch.ones(1, len(ratios)), **extra)


def test_gspo_clips_the_sequence_ratio_and_keeps_each_tokens_gradient() -> None:
    # row ratios 2 and 0.5: their geometric mean is 1 -> each token's loss -A·1, gradient -A
    balanced = _tokens([2.0, 0.5], [1.0, 1.0])
    terms = PG_LOSSES["gspo"](balanced, ClipRange())
    assert terms.per_token[0].tolist() == pytest.approx([-1.0, -1.0])
    terms.per_token.sum().backward()
    assert balanced.logprobs.grad[0].tolist() == pytest.approx([-1.0, -1.0])  # type: ignore[index]
    # ratios 1.5 and 1.5: s = 1.5 > 1.2, clipped: -1.2 per token, no gradient
    high = _tokens([1.5, 1.5], [1.0, 1.0])
    terms = PG_LOSSES["gspo"](high, ClipRange())
    assert terms.per_token[0].tolist() == pytest.approx([-1.2, -1.2]) and terms.clipped.sum() == 2
    assert (-terms.kl)[0].tolist() == pytest.approx([math.log(1.5)] * 2)


def test_cispo_weighs_log_pi_by_the_clipped_ratio() -> None:
    # r = 1.5 -> 1.2 (clipped), r = 1.1 kept; l = -sg(clip r)·A·log π with log π = -1, A = 1
    inputs = _tokens([1.5, 1.1], [1.0, 1.0])
    terms = PG_LOSSES["cispo"](inputs, ClipRange())
    assert terms.per_token[0].tolist() == pytest.approx([1.2, 1.1])
    assert terms.clipped[0].tolist() == [1.0, 0.0]
    terms.per_token.sum().backward()
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-1.2, -1.1])  # type: ignore[index]


def test_sapo_gates_the_ratio_smoothly() -> None:
    # r = 1: σ(0)·4/τ = 2/τ; A = 1 (τ_pos = 1) -> -2; A = -1 (τ_neg = 1.05) -> +2/1.05
    inputs = _tokens([1.0, 1.0], [1.0, -1.0])
    terms = PG_LOSSES["sapo"](inputs, ClipRange(), LossParameters(tau_pos=1.0, tau_neg=1.05))
    assert terms.per_token[0].tolist() == pytest.approx([-2.0, 2 / 1.05])
    terms.per_token.sum().backward()
    # d/d log π of -A·f(r) at r = 1: -A·σ'(0)·4 = -A
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-1.0, 1.0])  # type: ignore[index]


def test_gpg_is_minus_log_pi_times_the_advantage() -> None:
    terms = PG_LOSSES["gpg"](_tokens([3.0], [0.5], logprobs=[-2.0]), ClipRange())
    assert terms.per_token.item() == pytest.approx(1.0) and terms.clipped.sum() == 0


def test_clip_cov_cuts_the_selected_tokens() -> None:
    inputs = _tokens([1.1, 1.1], [1.0, 1.0], selected=torch.tensor([[0.0, 1.0]]))
    terms = PG_LOSSES["clip_cov"](inputs, ClipRange())
    assert terms.per_token[0].tolist() == pytest.approx([-1.1, 0.0])
    assert terms.clipped[0].tolist() == [0.0, 1.0]  # pg_clipfrac: the share cut
    terms.per_token.sum().backward()
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-1.1, 0.0])  # type: ignore[index]


def test_kl_cov_penalises_the_selected_tokens_and_clips_nothing() -> None:
    # r = 2, A = 1: -2 unclipped; the selected one adds 0.1·|ln 2|
    inputs = _tokens([2.0, 2.0], [1.0, 1.0], selected=torch.tensor([[1.0, 0.0]]))
    terms = PG_LOSSES["kl_cov"](inputs, ClipRange(), LossParameters(ppo_kl_coef=0.1))
    assert terms.per_token[0].tolist() == pytest.approx([-2 + 0.1 * math.log(2), -2.0])
    assert terms.kl[0].tolist() == pytest.approx([math.log(2)] * 2)  # verl's ppo_kl: |log r|


def test_geo_mean_by_hand() -> None:
    # log r = [ln 1.5, ln 0.5], A = 1, ε = 0.2: clipped toward the sign: [0.2, ln 0.5]
    # R = exp((0.2 + ln 0.5) / 2), L = -R on both tokens; both log-ratios were clipped-compared
    inputs = _tokens([1.5, 0.5], [1.0, 1.0])
    terms = PG_LOSSES["geo_mean"](inputs, ClipRange())
    ratio = math.exp((0.2 + math.log(0.5)) / 2)
    assert terms.per_token[0].tolist() == pytest.approx([-ratio, -ratio])
    assert terms.clipped[0].tolist() == [1.0, 1.0] and terms.clipped_lower.sum() == 0
    terms.per_token[0, 0].backward()  # one token holds the sequence's loss: dL/dlog π = -R/2 on t1 only
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([0.0, -ratio / 2])  # type: ignore[index]


def test_ppo_kl_is_clamped_as_verl_clamps_it() -> None:
    # verl's vanilla loss clamps log π_θ - log π_old at ±20 before its ppo_kl: e^30 reports -20
    terms = ppo_clip(_tokens([math.exp(30.0)], [1.0]), ClipRange())
    assert terms.kl.item() == pytest.approx(-20.0)
