"""Per-token policy-gradient losses (verl's `compute_policy_loss_<mode>`), before aggregation.

Each loss maps `PgInputs`, a `ClipRange` and the `LossParameters` to `PgTerms`: the `[B, T]`
loss of every token (0 off the mask) and per-token indicators the caller averages into the
metrics (`actor/pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl`), each computed as verl's loss of
that name computes it (which log-ratio is clamped for `ppo_kl`, say). Reducing `per_token` to
the scalar that is optimised is `aggregate`'s job; the losses verl reduces its own way
(`gspo`, `sapo`: sequence means; `geo_mean`: one value per sequence, here spread over its
tokens) have that aggregation forced by `config.loss_choice`.

Notation: `r = π_θ/π_old` per token (`exp(clamp(log π_θ - log π_old, ±20))`), `A` the token's
advantage, `w` the detached rollout-correction IS weight (1 when off), ε_low/ε_high the clip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollover.config.loss_choice import PgLoss
from rollover.training.loss.masked import LOG_RATIO_BOUND, on_mask, valid_mask
from rollover.training.update_settings import ClipRange, LossParameters

# GSPO clamps its sequence log-ratio from above only, at 10 (verl's bound).
_GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class PgInputs:
    """The `[B, T]` target-aligned tensors of one micro-batch.

    `logprobs` is `log π_θ` and the only input that should carry gradient; `old_logprobs` is
    `log π_old` (in bypass mode the behaviour policy's `log μ`); `advantages` may also be
    `[B, 1]`; `is_weights` are detached truncated importance weights that multiply each
    token's loss, or None; `selected` marks the tokens clip_cov cuts and kl_cov penalises
    (`covariance`), or None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor | None = None
    selected: torch.Tensor | None = None


@dataclass(frozen=True)
class PgTerms:
    """A policy loss per token, and per-token 0/1 float indicators for metrics.

    - `per_token`: the loss, 0 off the mask.
    - `clipped`: the token counts in `actor/pg_clipfrac` (verl's numerator for this loss).
    - `clipped_lower`: the token counts in `actor/pg_clipfrac_lower` (dual clip; 0 where the loss
      has none).
    - `kl`: detached; its token mean is `actor/ppo_kl` (`log π_old - log π_θ`, clamped at ±20 where
      verl's loss clamps it; kl_cov reports `|log r|`).
    """

    per_token: torch.Tensor
    clipped: torch.Tensor
    clipped_lower: torch.Tensor
    kl: torch.Tensor


PgLossFn = Callable[[PgInputs, ClipRange, LossParameters], PgTerms]


@dataclass(frozen=True)
class _Masked:
    valid: torch.Tensor
    new: torch.Tensor  # log π_θ, 0 off the mask (carries gradient)
    old: torch.Tensor  # log π_old, detached
    adv: torch.Tensor  # A, detached

    @property
    def log_ratio(self) -> torch.Tensor:
        return self.new - self.old

    @property
    def clamped_log_ratio(self) -> torch.Tensor:
        return self.log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _masked(inputs: PgInputs) -> _Masked:
    valid = valid_mask(inputs.mask)
    return _Masked(
        valid,
        on_mask(inputs.logprobs, valid),
        on_mask(inputs.old_logprobs.detach(), valid),
        on_mask(inputs.advantages.detach().expand_as(inputs.logprobs), valid),
    )


def _weighted(per_token: torch.Tensor, inputs: PgInputs, valid: torch.Tensor) -> torch.Tensor:
    """`l · w` with `w` the detached IS weights (0 off the mask), or `l` when there are none."""
    if inputs.is_weights is None:
        return per_token
    return per_token * on_mask(inputs.is_weights.detach(), valid)


def _terms(
    per_token: torch.Tensor, clipped: torch.Tensor, lower: torch.Tensor, kl: torch.Tensor, valid: torch.Tensor
) -> PgTerms:
    return PgTerms(
        per_token=torch.where(valid, per_token, torch.zeros((), device=per_token.device)),
        clipped=(clipped & valid).float(),
        clipped_lower=(lower & valid).float(),
        kl=torch.where(valid, kl.detach(), torch.zeros((), device=kl.device)),
    )


def ppo_clip(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """Dual-clip PPO with clip-higher (verl's `vanilla`).

    `l1 = -A·r`, `l2 = -A·clamp(r, 1 - ε_low, 1 + ε_high)`, `l = max(l1, l2)`; for `A < 0` also
    `l = min(l, -c·A)` (c = clip_ratio_c), so a huge ratio on a bad token cannot blow up;
    finally `l·w`. `ppo_kl`: the clamped `-log r`.
    """
    t = _masked(inputs)
    ratio = torch.exp(t.clamped_log_ratio)
    unclipped = -t.adv * ratio
    clipped = -t.adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_cap = -clip.dual_c * t.adv
    negative = t.adv < 0
    per_token = torch.where(negative, torch.minimum(pessimistic, dual_cap), pessimistic)
    return _terms(
        _weighted(per_token, inputs, t.valid),
        clipped > unclipped,
        negative & (pessimistic > dual_cap),
        -t.clamped_log_ratio,
        t.valid,
    )


def reinforce(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """REINFORCE (verl's `compute_policy_loss_reinforce`): `l = -A · log π_θ · w`.

    Nothing is clipped (`clip` is unused; one signature for every loss). `ppo_kl`: `-log r`
    unclamped, against π_old (in bypass mode μ, as verl reports it).
    """
    t = _masked(inputs)
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(-t.adv * t.new, inputs, t.valid), none, none, -t.log_ratio, t.valid)


def gspo(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """GSPO (Zheng et al. 2025; verl's `gspo`): one ratio per sequence, its tokens' gradients.

    `s = exp(mean_t log r_t)` (the sequence's length-normalised ratio, detached), per token
    `s_t = exp(min(sg(log s) + log π_θ - sg(log π_θ), 10))`, `l = max(-A·s_t, -A·clamp(s_t,
    1 - ε_low, 1 + ε_high))·w`; no dual clip. Reduced seq-mean-token-mean (forced).
    `ppo_kl`: `-log r` unclamped.
    """
    t = _masked(inputs)
    lengths = t.valid.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (t.log_ratio.sum(dim=-1, keepdim=True) / lengths).detach()
    token_log_ratio = (seq_log_ratio + t.new - t.new.detach()).clamp(max=_GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(token_log_ratio)
    unclipped = -t.adv * ratio
    clipped = -t.adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    per_token = torch.maximum(unclipped, clipped)
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(per_token, inputs, t.valid), clipped > unclipped, none, -t.log_ratio, t.valid)


def cispo(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """CISPO (MiniMax-M1; verl's `cispo`): `l = -sg(clamp(r, 1 - ε_low, 1 + ε_high))·A·log π_θ·w`.

    The clipped ratio only weighs the token; the gradient flows through log π_θ alone, so no
    token loses its gradient to the clip. `pg_clipfrac`: tokens whose ratio was clipped.
    `ppo_kl`: the clamped `-log r`.
    """
    t = _masked(inputs)
    ratio = torch.exp(t.clamped_log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    per_token = -clipped_ratio.detach() * t.adv * t.new
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(per_token, inputs, t.valid), ratio != clipped_ratio, none, -t.clamped_log_ratio, t.valid)


def sapo(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """SAPO (Gao et al. 2025; verl's `sapo`): a smooth gate instead of the clip.

    `f(r) = σ(τ·(r - 1))·4/τ` with `τ = tau_pos` where `A > 0` and `tau_neg` elsewhere,
    `l = -f(r)·A·w`; its gradient is `σ'`-shaped around r = 1 instead of cut at 1 ± ε.
    Reduced seq-mean-token-mean (forced); nothing counts as clipped. `ppo_kl`: the clamped `-log r`.
    """
    t = _masked(inputs)
    ratio = torch.exp(t.clamped_log_ratio)
    tau = torch.where(
        t.adv > 0,
        torch.tensor(parameters.tau_pos, device=ratio.device),
        torch.tensor(parameters.tau_neg, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(-gate * t.adv, inputs, t.valid), none, none, -t.clamped_log_ratio, t.valid)


def gpg(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """GPG (Chu et al. 2025; verl's `gpg`): `l = -log π_θ·A·w`, no ratio and no clip (verl logs
    no metric for it: `ppo_kl` here is `-log r` unclamped, for the record)."""
    t = _masked(inputs)
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(-t.new * t.adv, inputs, t.valid), none, none, -t.log_ratio, t.valid)


def clip_cov(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """Clip-Cov (Cui et al. 2025; verl's `clip_cov`): PPO's clip without the dual clip, and the
    gradient of the `selected` tokens cut (`covariance.clip_cov_selection`: a random share
    `clip_cov_ratio` of the tokens whose covariance of A and log π lies in (lb, ub)).

    `l = max(-A·r, -A·clamp(r, 1 - ε_low, 1 + ε_high))·(1 - selected)·w` with r unclamped (as
    verl); `pg_clipfrac`: the share of tokens cut. `ppo_kl`: `-log r` unclamped.
    """
    t = _masked(inputs)
    ratio = torch.exp(t.log_ratio)
    per_token = torch.maximum(-t.adv * ratio, -t.adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high))
    cut = inputs.selected.bool() if inputs.selected is not None else torch.zeros_like(t.valid)
    per_token = torch.where(cut, torch.zeros((), device=per_token.device), per_token)
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(per_token, inputs, t.valid), cut, none, -t.log_ratio, t.valid)


def kl_cov(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """KL-Cov (Cui et al. 2025; verl's `kl_cov`): no clip at all; the `selected` tokens (the share
    `kl_cov_ratio` of largest covariance of A and log π, `covariance.kl_cov_selection`) pay a KL
    penalty: `l = (-A·r + ppo_kl_coef·|log r|·selected)·w`, r unclamped (as verl).
    `ppo_kl`: `|log r|` (verl reports its mean under that name); nothing counts as clipped.
    """
    t = _masked(inputs)
    log_ratio = t.log_ratio
    penalised = inputs.selected.bool() if inputs.selected is not None else torch.zeros_like(t.valid)
    per_token = -t.adv * torch.exp(log_ratio)
    per_token = torch.where(penalised, per_token + parameters.ppo_kl_coef * log_ratio.abs(), per_token)
    none = torch.zeros_like(t.valid)
    return _terms(_weighted(per_token, inputs, t.valid), none, none, log_ratio.abs(), t.valid)


def geo_mean(inputs: PgInputs, clip: ClipRange, parameters: LossParameters = LossParameters()) -> PgTerms:
    """GMPO (Zhao et al. 2025; verl's `geo_mean`): the geometric mean of the token ratios, one
    loss per sequence.

    Per token the log-ratio is clipped toward the advantage's sign: `x_t = sgn(A)·min(sgn(A)·
    log r_t, sgn(A)·clamp(log r_t, -ε_low, ε_high))`; per sequence `R = exp(mean_t x_t)`,
    `Ā = mean_t A_t`, `L = -Ā·R·ω` with `ω` the geometric mean of the IS weights. `L` is spread
    over the sequence's tokens (each holds L) and reduced seq-mean-token-mean (forced): the mean
    of the sequences' L, as verl's `torch.mean` over rows. `pg_clipfrac` / `pg_clipfrac_lower`:
    clipped tokens with A > 0 / A < 0. `ppo_kl`: `-log r` unclamped.
    """
    t = _masked(inputs)
    log_ratio = t.log_ratio
    sign = torch.sign(t.adv)
    bounded = log_ratio.clamp(-clip.low, clip.high)
    toward = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = t.valid.sum(dim=-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(on_mask(toward, t.valid).sum(dim=-1, keepdim=True) / lengths)
    advantage = t.adv.sum(dim=-1, keepdim=True) / lengths
    per_sequence = -advantage * ratio
    if inputs.is_weights is not None:
        log_w = torch.log(on_mask(inputs.is_weights.detach(), t.valid) + 1e-10)
        per_sequence = per_sequence * torch.exp(on_mask(log_w, t.valid).sum(dim=-1, keepdim=True) / lengths)
    per_token = per_sequence.expand_as(log_ratio)
    was_clipped = log_ratio != bounded
    return _terms(per_token, was_clipped & (t.adv > 0), was_clipped & (t.adv < 0), -log_ratio, t.valid)


PG_LOSSES: dict[PgLoss, PgLossFn] = {
    "ppo_clip": ppo_clip,
    "reinforce": reinforce,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo,
    "gpg": gpg,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
}
