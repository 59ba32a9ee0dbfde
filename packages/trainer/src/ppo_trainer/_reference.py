"""Plain-loop references for the PPO math in ``_math`` (element by element).

Slow and obvious on purpose: the tests check the vectorised functions against these.
Inputs are nested lists ``[B][T]`` of scalars; outputs likewise (or one scalar). A
scalar is a Python float or a 0-d tensor: fed 0-d tensors that require grad (e.g.
``[[x[b, t] for t in ...] for b in ...]``) the loops build an autograd graph, so the
tests compare gradients too. Masked positions are skipped (never computed), so they
cannot influence a value or a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ppo_trainer._math import MAX_LOG_RATIO

__all__ = [
    "aggregate_loss_loop",
    "entropy_loop",
    "gae_loop",
    "kl_loop",
    "masked_mean_loop",
    "masked_whiten_loop",
    "policy_loss_loop",
    "value_loss_loop",
]

Scalar = float | Tensor
"""A Python float, or a 0-d tensor (autograd flows through the loops)."""
Grid = Sequence[Sequence[Scalar]]


def _exp(x: Scalar) -> Scalar:
    return torch.exp(x) if isinstance(x, Tensor) else math.exp(x)


def _log(x: Scalar) -> Scalar:
    return torch.log(x) if isinstance(x, Tensor) else math.log(x)


def _sqrt(x: Scalar) -> Scalar:
    return torch.sqrt(x) if isinstance(x, Tensor) else math.sqrt(x)


def _float(x: Scalar) -> float:
    """The value of a scalar (metrics are not differentiated)."""
    return float(x.detach()) if isinstance(x, Tensor) else float(x)


def _clamp(x: Scalar, lo: float, hi: float) -> Scalar:
    """``x`` limited to ``[lo, hi]`` (a bound is a constant: no gradient beyond it)."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def _max(a: Scalar, b: Scalar) -> Scalar:
    return b if b > a else a


def _min(a: Scalar, b: Scalar) -> Scalar:
    return b if b < a else a


def gae_loop(
    *, rewards: Grid, values: Grid, mask: Grid, gamma: float, lam: float
) -> tuple[list[list[Scalar]], list[list[Scalar]]]:
    advantages: list[list[Scalar]] = [[0.0] * len(row) for row in values]
    returns: list[list[Scalar]] = [[0.0] * len(row) for row in values]
    for b in range(len(values)):
        positions = [t for t in range(len(values[b])) if mask[b][t] == 1]
        next_value: Scalar = 0.0
        next_adv: Scalar = 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            adv = delta + gamma * lam * next_adv
            advantages[b][t] = adv
            returns[b][t] = adv + values[b][t]
            next_value = values[b][t]
            next_adv = adv
    return advantages, returns


def masked_mean_loop(*, values: Grid, mask: Grid) -> Scalar:
    total: Scalar = 0.0
    count = 0.0
    for vrow, mrow in zip(values, mask, strict=True):
        for v, m in zip(vrow, mrow, strict=True):
            if m:
                total += v
                count += 1
    return total / max(count, 1.0)


def masked_whiten_loop(*, values: Grid, mask: Grid, eps: float = 1e-8) -> list[list[Scalar]]:
    picked = [
        v for vr, mr in zip(values, mask, strict=True) for v, m in zip(vr, mr, strict=True) if m
    ]
    n = len(picked)
    mean = sum(picked, start=0.0) / max(n, 1)
    var = sum(((v - mean) ** 2 for v in picked), start=0.0) / max(n - 1, 1)
    scale = 1.0 / _sqrt(var + eps)
    return [
        [(v - mean) * scale if m else 0.0 for v, m in zip(vr, mr, strict=True)]
        for vr, mr in zip(values, mask, strict=True)
    ]


def aggregate_loss_loop(
    *, loss: Grid, mask: Grid, mode: str, denominator: float | None = None
) -> Scalar:
    total: Scalar = 0.0
    if mode == "token":
        total = sum(
            (
                v
                for lr, mr in zip(loss, mask, strict=True)
                for v, m in zip(lr, mr, strict=True)
                if m
            ),
            start=0.0,
        )
        count = sum(1 for mr in mask for m in mr if m)
    else:
        count = 0
        for lr, mr in zip(loss, mask, strict=True):
            vals = [v for v, m in zip(lr, mr, strict=True) if m]
            if vals:
                total = total + sum(vals, start=0.0) / len(vals)
                count += 1
    den = denominator if denominator is not None else max(count, 1)
    return total / den


def policy_loss_loop(
    *,
    logprobs: Grid,
    old_logprobs: Grid,
    advantages: Grid,
    mask: Grid,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: str = "token",
    denominator: float | None = None,
) -> tuple[Scalar, float, float]:
    """Returns ``(pg_loss, clipfrac, approx_kl)``; ``approx_kl`` is the mean k3 estimate
    of KL(old || new) over valid tokens: ``(ratio - 1) - log(ratio)``."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    per_token: list[list[Scalar]] = []
    clipped, kl, count = 0.0, 0.0, 0
    for b in range(len(logprobs)):
        row: list[Scalar] = []
        for t in range(len(logprobs[b])):
            if not mask[b][t]:
                row.append(0.0)  # never computed: no value, no gradient
                continue
            a = advantages[b][t]
            log_ratio = _clamp(logprobs[b][t] - old_logprobs[b][t], -MAX_LOG_RATIO, MAX_LOG_RATIO)
            ratio = _exp(log_ratio)
            l1 = -a * ratio
            l2 = -a * _clamp(ratio, 1.0 - eps_clip, 1.0 + high)
            loss = _max(l1, l2)
            if dual_clip is not None and a < 0:
                loss = _min(loss, -dual_clip * a)
            row.append(loss)
            count += 1
            clipped += 1.0 if l2 > l1 else 0.0
            kl += _float(ratio - 1.0 - log_ratio)
        per_token.append(row)
    pg = aggregate_loss_loop(loss=per_token, mask=mask, mode=loss_agg, denominator=denominator)
    return pg, clipped / max(count, 1), kl / max(count, 1)


def value_loss_loop(
    *,
    values: Grid,
    old_values: Grid,
    returns: Grid,
    mask: Grid,
    value_clip: float | None,
    loss_agg: str = "token",
    denominator: float | None = None,
) -> tuple[Scalar, float]:
    """Returns ``(v_loss, clipfrac)``."""
    per_token: list[list[Scalar]] = []
    clipped, count = 0.0, 0
    for b in range(len(values)):
        row: list[Scalar] = []
        for t in range(len(values[b])):
            if not mask[b][t]:
                row.append(0.0)  # never computed: no value, no gradient
                continue
            v, old, r = values[b][t], old_values[b][t], returns[b][t]
            plain = (v - r) ** 2
            if value_clip is None:
                row.append(0.5 * plain)
                continue
            v_clip = old + _clamp(v - old, -value_clip, value_clip)
            other = (v_clip - r) ** 2
            row.append(0.5 * _max(plain, other))
            count += 1
            clipped += 1.0 if other > plain else 0.0
        per_token.append(row)
    loss = aggregate_loss_loop(loss=per_token, mask=mask, mode=loss_agg, denominator=denominator)
    return loss, clipped / max(count, 1)


def kl_loop(
    *, logprobs: Grid, ref_logprobs: Grid, estimator: str, mask: Grid | None = None
) -> list[list[Scalar]]:
    """Per-token estimate of KL(policy || reference), ``log_r = ref - logprob``; 0 where
    ``mask`` is 0 (not computed)."""
    out: list[list[Scalar]] = []
    for b, (lrow, rrow) in enumerate(zip(logprobs, ref_logprobs, strict=True)):
        row: list[Scalar] = []
        for t, (lp, ref) in enumerate(zip(lrow, rrow, strict=True)):
            if mask is not None and not mask[b][t]:
                row.append(0.0)
                continue
            log_r = ref - lp
            if estimator == "k1":
                row.append(-log_r)
            elif estimator == "k2":
                row.append(0.5 * log_r * log_r)
            else:
                log_r = _clamp(log_r, -MAX_LOG_RATIO, MAX_LOG_RATIO)
                row.append(_exp(log_r) - 1.0 - log_r)
        out.append(row)
    return out


def entropy_loop(*, logits: Sequence[Scalar]) -> Scalar:
    """``-sum p log p`` over the entries with ``p > 0`` (``-inf`` logits contribute 0)."""
    top = _max_of(logits)
    exps = [_exp(x - top) for x in logits]
    z = sum(exps, start=0.0)
    return -sum(((e / z) * _log(e / z) for e in exps if e > 0), start=0.0)


def _max_of(xs: Sequence[Scalar]) -> Scalar:
    top = xs[0]
    for x in xs[1:]:
        top = _max(top, x)
    return top
