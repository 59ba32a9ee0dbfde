"""PPO math as pure functions on ``[B, T]`` tensors (shifted layout of docs/interfaces.md).

Every function takes keyword-only arguments, checks shapes up front (``ValueError``
naming the argument) and never mutates its inputs. ``mask`` is 1.0 at the positions a
loss uses and 0.0 elsewhere; masked positions never influence a result, its gradient
included: a masked position may hold anything (``inf``, ``nan``, a log-ratio of 100)
and still gets a gradient of exactly 0 while every other gradient stays finite.

How: each input is replaced by 0 at masked positions with ``torch.where`` BEFORE any
nonlinearity (``exp``, squares). Masking only the result is not enough: the forward
pass is fine, but backward multiplies the zero upstream gradient by the local
derivative, and ``0 * inf = nan`` (float32 ``exp`` overflows at a log-ratio of ~88.7)
then reaches every parameter. ``torch.where`` routes no gradient to the branch it did
not select, so nothing from a masked position survives.

Plain-loop references live in ``ppo_trainer._reference`` and the tests check they
agree, values and gradients.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ppo_trainer._config import TrainerProblem

__all__ = [
    "MAX_LOG_RATIO",
    "Moments",
    "PolicyLoss",
    "ValueLoss",
    "aggregate_loss",
    "check_reward_kl",
    "entropy_from_logits",
    "gae",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "reward_kl_problem",
    "value_loss",
]


MAX_LOG_RATIO = 20.0
"""Bound on ``|log-ratio|`` before ``exp`` (importance ratio and k3 KL), as in verl.

``exp(20) ~ 4.9e8`` is finite in float32 and float64 (the dtypes of the log-probs here:
``logprobs_from_logits`` upcasts half precision), so an unmasked extreme token gives a
finite loss and finite gradients. Beyond the bound the value saturates and the gradient
through that token's ratio is 0 (a token whose probability changed by a factor above
``4.9e8`` is treated as an outlier, not followed). For ``|log-ratio| <= 20`` nothing
changes.
"""


def _valid_only(values: Tensor, valid: Tensor) -> Tensor:
    """``values`` with 0 at the masked positions (``valid`` False), taken before any
    nonlinearity: no masked value reaches the forward result or the gradient."""
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _at_least_float32(t: Tensor) -> Tensor:
    """Upcast half-precision logits to float32; float32 and float64 stay as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _check_2d(**tensors: Tensor) -> None:
    shape: torch.Size | None = None
    first = ""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got {tuple(t.shape)}")
        if shape is None:
            shape, first = t.shape, name
        elif t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {first} has {tuple(shape)}; "
                "all inputs must share one [B, T] shape"
            )


def _check_same(values: Tensor, mask: Tensor, *, name: str = "values") -> None:
    if values.shape != mask.shape:
        raise ValueError(
            f"{name} has shape {tuple(values.shape)} but mask has {tuple(mask.shape)}; "
            "they must match"
        )


def masked_sum(*, values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values * mask`` (over everything, or along ``dim``). Same shapes."""
    _check_same(values, mask)
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(*, values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask == 1``; 0 where nothing is valid.

    ``values, mask: [B, T]`` (any equal shapes); ``dim=None`` reduces everything.
    """
    total = masked_sum(values=values, mask=mask, dim=dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_whiten(
    *, values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Advantage normalisation: ``(values - mean) / sqrt(var + eps)`` over valid positions.

    ``values, mask: [B, T]``. Mean and the unbiased variance (Bessel-corrected; 0 with
    fewer than two valid positions) are taken over ``mask == 1``. With
    ``shift_mean=False`` the mean is added back (scale only). Masked positions get 0.
    """
    _check_2d(values=values, mask=mask)
    m = mask.to(values.dtype)
    count = m.sum()
    mean = masked_mean(values=values, mask=mask)
    centered = torch.where(mask.bool(), values - mean, torch.zeros_like(values))
    var = (centered * centered).sum() / (count - 1.0).clamp(min=1.0)
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(values))


class Moments(NamedTuple):
    """Number, mean and Bessel-corrected variance of the valid positions (Python floats,
    computed in float64): the statistics ``masked_whiten`` uses, as data that can be
    kept and applied later (``whiten_with``)."""

    n: float
    mean: float
    var: float


def masked_moments(*, values: Tensor, mask: Tensor) -> Moments:
    """``Moments`` of ``values`` over ``mask == 1`` (``values, mask: [B, T]``); the
    variance is 0 with fewer than two valid positions, as in ``masked_whiten``."""
    _check_2d(values=values, mask=mask)
    valid = _valid_only(values.detach().to(torch.float64), mask.bool())
    count = float(mask.bool().sum().item())
    if count == 0:
        return Moments(0.0, 0.0, 0.0)
    mean = float(valid.sum().item()) / count
    centered = torch.where(mask.bool(), valid - mean, torch.zeros_like(valid))
    var = float((centered * centered).sum().item()) / max(count - 1.0, 1.0)
    return Moments(count, mean, var)


def whiten_with(*, values: Tensor, mask: Tensor, stats: Moments, eps: float = 1e-8) -> Tensor:
    """``(values - stats.mean) / sqrt(stats.var + eps)`` at valid positions, 0 elsewhere:
    ``masked_whiten`` with statistics given instead of taken from ``values`` (e.g. fixed
    before a streamed step, so that every chunk is normalised alike). ``values, mask:
    [B, T]``; the result has ``values``' dtype."""
    _check_2d(values=values, mask=mask)
    if not (stats.var >= 0 and math.isfinite(stats.mean) and math.isfinite(stats.var)):
        raise ValueError(f"stats={stats!r} are invalid: need a finite mean and a variance >= 0")
    scaled = (values - stats.mean) * (1.0 / math.sqrt(stats.var + eps))
    return torch.where(mask.bool(), scaled, torch.zeros_like(values))


def gae(
    *, rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation per sample over its valid positions.

    ``rewards, values, mask: [B, T]`` -> ``(advantages, returns)``, both ``[B, T]``.
    For each sample the positions with ``mask == 1`` are taken in order; masked
    positions in between are skipped (their rewards and values are ignored). With
    ``V_next`` the value at the next valid position (0 after the last one):
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    ``returns = A + V``. Masked positions get 0 in both outputs. No gradient flows.
    """
    _check_2d(rewards=rewards, values=values, mask=mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma!r} is invalid: use a discount in [0, 1]")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam!r} is invalid: use a GAE lambda in [0, 1]")
    with torch.no_grad():
        valid = mask.bool()
        rewards = rewards.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in range(values.shape[1] - 1, -1, -1):
            v = values[:, t]
            delta = rewards[:, t] + gamma * next_value - v
            adv = delta + gamma * lam * next_adv
            keep = valid[:, t]
            advantages[:, t] = torch.where(keep, adv, torch.zeros_like(adv))
            next_value = torch.where(keep, v, next_value)
            next_adv = torch.where(keep, adv, next_adv)
        returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return advantages, returns


def logprobs_from_logits(*, logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[..., labels]``: ``logits [..., V]``, ``labels [...]`` -> ``[...]``.

    Computed in float32 (float64 logits stay float64). ``-inf`` logits (a vocabulary
    mask) are fine: the log-sum-exp is stable and the gradient is ``onehot - softmax``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has {tuple(logits.shape)}; "
            "labels must match logits without the vocabulary dimension"
        )
    logits = _at_least_float32(logits)
    picked = torch.gather(logits, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(*, logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)``: ``logits [..., V]`` -> ``[...]``.

    ``H = logsumexp(z) - sum(p * z)``, in float32 (float64 logits stay float64). Entries
    with ``p == 0`` (``-inf`` logits, or underflow) are left out of ``sum(p * z)``:
    ``0 * -inf`` would be ``nan`` in the value and the gradient; their true term is 0.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension, got a scalar")
    logits = _at_least_float32(logits)
    logz = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(probs > 0, logits, torch.zeros((), dtype=logits.dtype))
    return logz - (probs * finite).sum(dim=-1)


def kl_penalty(
    *, logprobs: Tensor, ref_logprobs: Tensor, estimator: str, mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(policy || reference) for the KL *loss*: ``[B, T]`` -> ``[B, T]``.

    Direction: the tokens were sampled from the policy (the rollout policy, which the
    current one equals up to the update), so these estimate
    ``KL(pi || ref) = E_{x ~ pi}[log pi(x) - log ref(x)]`` (Schulman's k1/k2/k3 with
    ``r = ref(x) / pi(x)``). With ``log_r = ref_logprobs - logprobs``:

    * ``k1 = -log_r`` (unbiased, can be negative; verl's ``kl``),
    * ``k2 = log_r**2 / 2`` (biased, non-negative; verl's ``mse``),
    * ``k3 = exp(log_r) - 1 - log_r`` (unbiased, non-negative, low variance; verl's
      ``low_var_kl``), with ``log_r`` clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]``
      before ``exp`` so an extreme token stays finite (its gradient is 0 beyond the bound).
      verl also clamps the estimate itself to ``[-10, 10]`` (no gradient beyond, from
      ``log_r`` above about 2.5); here it stays exact there, so a token far from the
      reference keeps pulling back towards it.

    ``mask`` (``[B, T]``, optional): positions with 0 get 0 and exactly zero gradient
    whatever they hold; pass it whenever masked positions may hold arbitrary values (the
    loss is reduced with ``aggregate_loss`` over the same mask). ``None``: every position
    is treated as valid.
    """
    _check_2d(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = ref_logprobs - logprobs
    if mask is not None:
        _check_same(logprobs, mask, name="logprobs")
        log_r = _valid_only(log_r, mask.bool())
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        log_r = torch.clamp(log_r, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator={estimator!r} is unknown: use 'k1', 'k2' or 'k3'")


def aggregate_loss(
    *, loss: Tensor, mask: Tensor, mode: str, denominator: float | Tensor | None = None
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    ``mode="token"``: ``sum(loss * mask) / denominator`` with ``denominator`` the number
    of valid tokens of the WHOLE step (over all chunks and ranks); ``None`` uses this
    batch's count. ``mode="sample"``: each sample's token mean, summed over samples,
    divided by ``denominator`` (the step's sample count; ``None``: this batch's samples
    with at least one valid token). Summing the results over chunks and ranks gives the
    full-batch loss exactly.
    """
    _check_2d(loss=loss, mask=mask)
    m = mask.to(loss.dtype)
    if mode == "token":
        total = masked_sum(values=loss, mask=mask)
        default = m.sum()
    elif mode == "sample":
        per_sample = masked_sum(values=loss, mask=mask, dim=1) / m.sum(dim=1).clamp(min=1.0)
        total = per_sample.sum()
        default = (m.sum(dim=1) > 0).to(loss.dtype).sum()
    else:
        raise ValueError(f"loss_agg={mode!r} is unknown: use 'token' or 'sample'")
    if denominator is None:
        return total / default.clamp(min=1.0)
    den = float(denominator) if not isinstance(denominator, Tensor) else denominator
    if (isinstance(den, float) and den <= 0) or (isinstance(den, Tensor) and bool(den <= 0)):
        raise ValueError(
            f"loss_denominator={float(den)!r} is invalid: pass the step's positive valid "
            "token (or sample) count"
        )
    return total / den


class PolicyLoss(NamedTuple):
    """``pg_loss``: scalar with gradient; ``clipfrac``, ``approx_kl``: detached scalars."""

    pg_loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor


class ValueLoss(NamedTuple):
    """``v_loss``: scalar with gradient; ``clipfrac``: detached fraction of clipped tokens."""

    v_loss: Tensor
    clipfrac: Tensor


def policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: str = "token",
    denominator: float | Tensor | None = None,
) -> PolicyLoss:
    """Clipped PPO surrogate, optionally dual-clipped. All inputs ``[B, T]``.

    ``log_ratio = logprobs - old_logprobs``, clamped to ``[-MAX_LOG_RATIO,
    MAX_LOG_RATIO]`` (as verl does: ``exp`` of an unmasked extreme token stays finite;
    beyond the bound that token's ratio saturates and passes no gradient);
    ``ratio = exp(log_ratio)``; per token
    ``l = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))``; with
    ``dual_clip = c > 1``, tokens with ``A < 0`` use ``min(l, -c * A)``. The per-token
    loss is reduced by ``aggregate_loss(mode=loss_agg, denominator=...)``. Masked
    positions are set to 0 before ``exp``: they get exactly zero gradient whatever they
    hold. ``clipfrac``: share of valid tokens where the clipped branch is active;
    ``approx_kl``: mean over valid tokens of the k3 estimate of KL(old || new), the
    direction that is unbiased for tokens sampled from the old policy:
    ``(ratio - 1) - log_ratio`` (as Stable-Baselines3 and CleanRL).
    """
    _check_2d(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if not eps_clip > 0 or not high > 0:
        raise ValueError(
            f"eps_clip={eps_clip!r}, eps_clip_high={eps_clip_high!r} are invalid: use positive values"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip!r} is invalid: use a constant > 1 or None")
    valid = mask.bool()
    log_ratio = _valid_only(logprobs - old_logprobs, valid)
    log_ratio = torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    advantages = _valid_only(advantages, valid)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    if dual_clip is not None:
        per_token = torch.where(
            advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token
        )
    pg_loss = aggregate_loss(loss=per_token, mask=mask, mode=loss_agg, denominator=denominator)
    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).to(logprobs.dtype)
        clipfrac = masked_mean(values=clipped, mask=mask)
        approx_kl = masked_mean(values=torch.expm1(log_ratio) - log_ratio, mask=mask)
    return PolicyLoss(pg_loss=pg_loss, clipfrac=clipfrac, approx_kl=approx_kl)


def value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    value_clip: float | None,
    loss_agg: str = "token",
    denominator: float | Tensor | None = None,
) -> ValueLoss:
    """Clipped value loss. All inputs ``[B, T]``.

    Per token ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
    ``V_clip = old_values + clip(V - old_values, -value_clip, value_clip)``;
    ``value_clip=None`` gives the plain ``0.5 * (V - R)^2``. Reduced like
    ``aggregate_loss``. Masked positions are set to 0 before squaring: they get exactly
    zero gradient whatever they hold. ``clipfrac``: share of valid tokens where the
    clipped term wins.
    """
    _check_2d(values=values, old_values=old_values, returns=returns, mask=mask)
    valid = mask.bool()
    values = _valid_only(values, valid)
    old_values = _valid_only(old_values, valid)
    returns = _valid_only(returns, valid)
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip={value_clip!r} is invalid: use a positive value or None")
        v_clip = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        clipped = (v_clip - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean(values=(clipped > unclipped).to(values.dtype), mask=mask)
    v_loss = aggregate_loss(loss=per_token, mask=mask, mode=loss_agg, denominator=denominator)
    return ValueLoss(v_loss=v_loss, clipfrac=clipfrac)


def reward_kl_problem(*, kl_coef: float, shared: bool = True) -> TrainerProblem | None:
    """Reward-level KL (``kl_coef != 0``, folded into the GAE rewards) when the actor and
    the critic share devices, as a problem record (``None``: allowed).

    In shared mode there is no channel that hands the actor's and reference's
    log-probabilities to the critic, so the critic would train on rewards without the
    KL term while the actor's advantages include it: a silently wrong target. Use the
    KL loss (``kl_loss_coef``) instead.
    """
    if not shared or kl_coef == 0:
        return None
    return TrainerProblem(
        "kl_coef",
        kl_coef,
        "reward-level KL (folded into the GAE rewards) is not supported when the actor "
        "and critic share GPUs: the critic cannot see the KL term and would fit the "
        "wrong target",
        "set kl_coef=0 and use the KL loss instead (kl_loss_coef > 0 with kl_estimator k1/k2/k3)",
        section="ppo",
    )


def check_reward_kl(*, kl_coef: float, shared: bool = True) -> None:
    """:func:`reward_kl_problem`, raised as ``ValueError``."""
    problem = reward_kl_problem(kl_coef=kl_coef, shared=shared)
    if problem is not None:
        raise ValueError(f"kl_coef={kl_coef!r}: {problem.message}; {problem.fix}")
