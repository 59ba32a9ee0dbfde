"""Plain-loop references for the PPO math in ``_math`` (element by element, Python floats).

Slow and obvious on purpose: the tests check the vectorised functions against these.
Inputs are nested lists ``[B][T]`` of floats; outputs likewise (or a float).
"""

from __future__ import annotations

import math

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

Grid = list[list[float]]


def gae_loop(
    *, rewards: Grid, values: Grid, mask: Grid, gamma: float, lam: float
) -> tuple[Grid, Grid]:
    advantages = [[0.0] * len(row) for row in values]
    returns = [[0.0] * len(row) for row in values]
    for b in range(len(values)):
        positions = [t for t in range(len(values[b])) if mask[b][t] == 1]
        next_value = 0.0
        next_adv = 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            adv = delta + gamma * lam * next_adv
            advantages[b][t] = adv
            returns[b][t] = adv + values[b][t]
            next_value = values[b][t]
            next_adv = adv
    return advantages, returns


def masked_mean_loop(*, values: Grid, mask: Grid) -> float:
    total, count = 0.0, 0.0
    for vrow, mrow in zip(values, mask, strict=True):
        for v, m in zip(vrow, mrow, strict=True):
            if m:
                total += v
                count += 1
    return total / max(count, 1.0)


def masked_whiten_loop(*, values: Grid, mask: Grid, eps: float = 1e-8) -> Grid:
    picked = [
        v for vr, mr in zip(values, mask, strict=True) for v, m in zip(vr, mr, strict=True) if m
    ]
    n = len(picked)
    mean = sum(picked) / max(n, 1)
    var = sum((v - mean) ** 2 for v in picked) / max(n - 1, 1)
    scale = 1.0 / math.sqrt(var + eps)
    return [
        [(v - mean) * scale if m else 0.0 for v, m in zip(vr, mr, strict=True)]
        for vr, mr in zip(values, mask, strict=True)
    ]


def aggregate_loss_loop(
    *, loss: Grid, mask: Grid, mode: str, denominator: float | None = None
) -> float:
    if mode == "token":
        total = sum(
            v for lr, mr in zip(loss, mask, strict=True) for v, m in zip(lr, mr, strict=True) if m
        )
        count = sum(1 for mr in mask for m in mr if m)
    else:
        total, count = 0.0, 0
        for lr, mr in zip(loss, mask, strict=True):
            vals = [v for v, m in zip(lr, mr, strict=True) if m]
            if vals:
                total += sum(vals) / len(vals)
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
) -> tuple[float, float, float]:
    """Returns ``(pg_loss, clipfrac, approx_kl)``."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    per_token: Grid = []
    clipped, kl, count = 0.0, 0.0, 0
    for b in range(len(logprobs)):
        row = []
        for t in range(len(logprobs[b])):
            a = advantages[b][t]
            log_ratio = logprobs[b][t] - old_logprobs[b][t]
            ratio = math.exp(log_ratio)
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1.0 - eps_clip), 1.0 + high)
            loss = max(l1, l2)
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            row.append(loss)
            if mask[b][t]:
                count += 1
                clipped += 1.0 if l2 > l1 else 0.0
                kl += math.exp(-log_ratio) - 1.0 + log_ratio
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
) -> tuple[float, float]:
    """Returns ``(v_loss, clipfrac)``."""
    per_token: Grid = []
    clipped, count = 0.0, 0
    for b in range(len(values)):
        row = []
        for t in range(len(values[b])):
            v, old, r = values[b][t], old_values[b][t], returns[b][t]
            plain = (v - r) ** 2
            if value_clip is None:
                row.append(0.5 * plain)
                continue
            v_clip = old + min(max(v - old, -value_clip), value_clip)
            other = (v_clip - r) ** 2
            row.append(0.5 * max(plain, other))
            if mask[b][t]:
                count += 1
                clipped += 1.0 if other > plain else 0.0
        per_token.append(row)
    loss = aggregate_loss_loop(loss=per_token, mask=mask, mode=loss_agg, denominator=denominator)
    return loss, clipped / max(count, 1)


def kl_loop(*, logprobs: Grid, ref_logprobs: Grid, estimator: str) -> Grid:
    out = []
    for lrow, rrow in zip(logprobs, ref_logprobs, strict=True):
        row = []
        for lp, ref in zip(lrow, rrow, strict=True):
            log_r = ref - lp
            if estimator == "k1":
                row.append(-log_r)
            elif estimator == "k2":
                row.append(0.5 * log_r * log_r)
            else:
                row.append(math.exp(log_r) - 1.0 - log_r)
        out.append(row)
    return out


def entropy_loop(*, logits: list[float]) -> float:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    z = sum(exps)
    return -sum((e / z) * math.log(e / z) for e in exps if e > 0)
