"""PPO math: vectorised functions against the plain-loop references (values and gradients),
independent hard-coded values, masked extremes, and the pinned GAE."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_trainer import (
    MAX_LOG_RATIO,
    aggregate_loss,
    check_reward_kl,
    entropy_from_logits,
    gae,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_moments,
    masked_whiten,
    policy_loss,
    value_loss,
    whiten_with,
)
from ppo_trainer._reference import (
    aggregate_loss_loop,
    entropy_loop,
    gae_loop,
    kl_loop,
    masked_mean_loop,
    masked_whiten_loop,
    policy_loss_loop,
    value_loss_loop,
)
from trainer_testlib import rounding_bound

T64 = torch.float64

# Vectorised function vs plain loop in float64: the same arithmetic in another order. At
# most B*T = 40 positions, each through at most 10 rounded operations, every intermediate
# below 100 in magnitude (inputs ~ N(0, 3^2), ratios <= e^3, GAE sums of <= 10 deltas):
# rounding_bound(terms=50, magnitude=40 * 100) ~ 9e-11.
F64_ATOL = rounding_bound(terms=50, magnitude=40 * 100.0, dtype=T64)
F64 = {"rtol": 0.0, "atol": F64_ATOL}
EPS = {torch.float32: torch.finfo(torch.float32).eps, T64: torch.finfo(T64).eps}


def _isclose(a: float, b: float) -> bool:
    return abs(a - b) <= F64_ATOL


def _t(grid: Sequence[Sequence[float | torch.Tensor]]) -> torch.Tensor:
    return torch.tensor([[float(x) for x in row] for row in grid], dtype=T64)


def _rand(b: int, t: int, seed: int, *, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, generator=g, dtype=T64) * scale


def _mask(b: int, t: int, seed: int, p: float = 0.6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return (torch.rand(b, t, generator=g) < p).to(T64)


# --------------------------------------------------------------------------- GAE (pinned)


def test_gae_hand_computed_with_a_skipped_position() -> None:
    # valid positions 1, 2, 4 (3 is a tool token: skipped); gamma=0.9, lam=0.5
    rewards = _t([[9.0, 0.0, 1.0, 7.0, 2.0, 5.0]])
    values = _t([[3.0, 0.5, 1.0, 8.0, 0.25, 4.0]])
    mask = _t([[0, 1, 1, 0, 1, 0]])
    adv, ret = gae(rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.5)
    d4 = 2.0 + 0.9 * 0.0 - 0.25  # last valid: V_next = 0
    a4 = d4
    d2 = 1.0 + 0.9 * 0.25 - 1.0  # next valid is 4, not 3
    a2 = d2 + 0.9 * 0.5 * a4
    d1 = 0.0 + 0.9 * 1.0 - 0.5
    a1 = d1 + 0.9 * 0.5 * a2
    expected_adv = _t([[0.0, a1, a2, 0.0, a4, 0.0]])
    torch.testing.assert_close(adv, expected_adv, **F64)
    torch.testing.assert_close(
        ret, torch.where(mask.bool(), expected_adv + values, 0 * values), **F64
    )


@pytest.mark.parametrize(
    ("b", "t", "gamma", "lam", "p"),
    [
        pytest.param(1, 1, 1.0, 1.0, 1.0, id="single-token"),
        pytest.param(3, 7, 1.0, 0.95, 0.7, id="gamma1"),
        pytest.param(4, 9, 0.9, 0.5, 0.5, id="discounted"),
        pytest.param(2, 5, 0.99, 0.0, 0.8, id="lam0-td"),
        pytest.param(3, 6, 0.5, 1.0, 0.0, id="all-masked"),
    ],
)
def test_gae_matches_loop(b: int, t: int, gamma: float, lam: float, p: float) -> None:
    rewards, values, mask = _rand(b, t, 1), _rand(b, t, 2), _mask(b, t, 3, p)
    adv, ret = gae(rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam)
    ra, rr = gae_loop(
        rewards=rewards.tolist(), values=values.tolist(), mask=mask.tolist(), gamma=gamma, lam=lam
    )
    torch.testing.assert_close(adv, _t(ra), **F64)
    torch.testing.assert_close(ret, _t(rr), **F64)
    assert bool((adv[mask == 0] == 0).all()) and bool((ret[mask == 0] == 0).all())


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 10),
    seed=st.integers(0, 10_000),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_property(b: int, t: int, seed: int, gamma: float, lam: float) -> None:
    rewards, values, mask = _rand(b, t, seed), _rand(b, t, seed + 1), _mask(b, t, seed)
    adv, ret = gae(rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam)
    ra, rr = gae_loop(
        rewards=rewards.tolist(), values=values.tolist(), mask=mask.tolist(), gamma=gamma, lam=lam
    )
    torch.testing.assert_close(adv, _t(ra), **F64)
    torch.testing.assert_close(ret, _t(rr), **F64)


def test_gae_ignores_masked_rewards_and_values() -> None:
    rewards, values, mask = _rand(3, 8, 5), _rand(3, 8, 6), _mask(3, 8, 7)
    noise = torch.where(mask.bool(), torch.zeros_like(values), _rand(3, 8, 8) * 100)
    a1, r1 = gae(rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.8)
    a2, r2 = gae(rewards=rewards + noise, values=values - noise, mask=mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(a1, a2, rtol=0, atol=0)  # masked values are never read
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"values": torch.zeros(2, 4)}, "values has shape", id="shape"),
        pytest.param({"mask": torch.zeros(2, 3, 1)}, r"mask must have shape \[B, T\]", id="dim"),
        pytest.param({"gamma": 1.5}, "gamma=1.5", id="gamma"),
        pytest.param({"lam": -0.1}, "lam=-0.1", id="lam"),
    ],
)
def test_gae_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "rewards": torch.zeros(2, 3),
        "values": torch.zeros(2, 3),
        "mask": torch.ones(2, 3),
        "gamma": 1.0,
        "lam": 0.95,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        gae(**args)


def test_gae_requires_keywords() -> None:
    with pytest.raises(TypeError):
        gae(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 1.0, 1.0)  # type: ignore[call-arg]


# --------------------------------------------------------------------------- losses


@pytest.mark.parametrize(
    ("eps", "eps_high", "dual", "agg", "den"),
    [
        pytest.param(0.2, None, None, "token", None, id="symmetric-token"),
        pytest.param(0.2, 0.28, None, "token", 50.0, id="asymmetric-denominator"),
        pytest.param(0.1, None, 3.0, "token", None, id="dual-clip"),
        pytest.param(0.2, 0.3, 2.0, "sample", None, id="sample"),
        pytest.param(0.2, None, None, "sample", 7.0, id="sample-denominator"),
    ],
)
def test_policy_loss_matches_loop(
    eps: float, eps_high: float | None, dual: float | None, agg: str, den: float | None
) -> None:
    b, t = 4, 9
    old = _rand(b, t, 10) - 2.0
    new = old + _rand(b, t, 11, scale=0.5)
    adv = _rand(b, t, 12, scale=2.0)
    mask = _mask(b, t, 13)
    out = policy_loss(
        logprobs=new,
        old_logprobs=old,
        advantages=adv,
        mask=mask,
        eps_clip=eps,
        eps_clip_high=eps_high,
        dual_clip=dual,
        loss_agg=agg,
        denominator=den,
    )
    pg, cf, kl = policy_loss_loop(
        logprobs=new.tolist(),
        old_logprobs=old.tolist(),
        advantages=adv.tolist(),
        mask=mask.tolist(),
        eps_clip=eps,
        eps_clip_high=eps_high,
        dual_clip=dual,
        loss_agg=agg,
        denominator=den,
    )
    assert _isclose(out.pg_loss.item(), float(pg))
    assert out.clipfrac.item() == cf  # a count over a count: exact
    assert _isclose(out.approx_kl.item(), kl)
    assert 0 < cf < 1  # the table exercises the clipped branch


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    adv = _t([[-1.0, -1.0]])
    old = _t([[0.0, 0.0]])
    new = _t([[3.0, 0.0]])  # ratio e^3 ~ 20 on the first token
    mask = _t([[1.0, 0.0]])
    plain = policy_loss(logprobs=new, old_logprobs=old, advantages=adv, mask=mask, eps_clip=0.2)
    dual = policy_loss(
        logprobs=new, old_logprobs=old, advantages=adv, mask=mask, eps_clip=0.2, dual_clip=3.0
    )
    assert _isclose(plain.pg_loss.item(), math.exp(3.0))
    assert _isclose(dual.pg_loss.item(), 3.0)


@pytest.mark.parametrize("clip", [None, 0.1, 0.5])
@pytest.mark.parametrize("agg", ["token", "sample"])
def test_value_loss_matches_loop(clip: float | None, agg: str) -> None:
    b, t = 3, 8
    old = _rand(b, t, 20)
    new = old + _rand(b, t, 21, scale=0.4)
    ret = _rand(b, t, 22)
    mask = _mask(b, t, 23)
    out = value_loss(
        values=new, old_values=old, returns=ret, mask=mask, value_clip=clip, loss_agg=agg
    )
    loss, cf = value_loss_loop(
        values=new.tolist(),
        old_values=old.tolist(),
        returns=ret.tolist(),
        mask=mask.tolist(),
        value_clip=clip,
        loss_agg=agg,
    )
    assert _isclose(out.v_loss.item(), float(loss))
    assert out.clipfrac.item() == cf


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_loop(estimator: str) -> None:
    lp, ref = _rand(3, 5, 30), _rand(3, 5, 31)
    out = kl_penalty(logprobs=lp, ref_logprobs=ref, estimator=estimator)
    torch.testing.assert_close(
        out,
        _t(kl_loop(logprobs=lp.tolist(), ref_logprobs=ref.tolist(), estimator=estimator)),
        **F64,
    )
    if estimator != "k1":
        assert bool((out >= 0).all())


def test_kl_estimator_unknown() -> None:
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        kl_penalty(logprobs=torch.zeros(1, 1), ref_logprobs=torch.zeros(1, 1), estimator="k4")


def test_entropy_and_logprobs_from_logits() -> None:
    logits = _rand(2, 3, 40, scale=3.0).reshape(2, 3, 1).expand(2, 3, 5) + _rand(6, 5, 41).reshape(
        2, 3, 5
    )
    ent = entropy_from_logits(logits=logits)
    for i in range(2):
        for j in range(3):
            assert _isclose(ent[i, j].item(), float(entropy_loop(logits=logits[i, j].tolist())))
    labels = torch.tensor([[0, 4, 2], [1, 1, 3]])
    lp = logprobs_from_logits(logits=logits, labels=labels)
    torch.testing.assert_close(
        lp,
        torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1),
        **F64,
    )


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 4), t=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_masked_mean_and_whiten_match_loop(b: int, t: int, seed: int) -> None:
    values, mask = _rand(b, t, seed, scale=3.0) + 1.0, _mask(b, t, seed)
    assert _isclose(
        masked_mean(values=values, mask=mask).item(),
        float(masked_mean_loop(values=values.tolist(), mask=mask.tolist())),
    )
    torch.testing.assert_close(
        masked_whiten(values=values, mask=mask),
        _t(masked_whiten_loop(values=values.tolist(), mask=mask.tolist())),
        **F64,
    )


def test_masked_whiten_statistics() -> None:
    values, mask = _rand(4, 16, 50, scale=5.0) + 3.0, _mask(4, 16, 51)
    w = masked_whiten(values=values, mask=mask)
    picked = w[mask.bool()]
    assert abs(picked.mean().item()) <= F64_ATOL
    # std of (x - mean) / sqrt(var + eps) is sqrt(var / (var + eps)), eps = 1e-8
    var = values[mask.bool()].var().item()
    assert _isclose(picked.std().item(), math.sqrt(var / (var + 1e-8)))
    shifted = masked_whiten(values=values, mask=mask, shift_mean=False)
    assert _isclose(shifted[mask.bool()].mean().item(), values[mask.bool()].mean().item())


@given(b=st.integers(1, 4), t=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_moments_and_whiten_with_match_masked_whiten(b: int, t: int, seed: int) -> None:
    """``masked_moments`` are the statistics ``masked_whiten`` uses (against the
    standard library's float64 mean and sample variance of the valid values), and
    whitening with them given is ``masked_whiten``; other statistics (fixed before a
    streamed step) shift and scale exactly as given."""
    values, mask = _rand(b, t, seed, scale=3.0) + 1.0, _mask(b, t, seed)
    valid = values[mask.bool()].tolist()
    m = masked_moments(values=values, mask=mask)
    assert m.n == len(valid)
    if valid:
        assert _isclose(m.mean, statistics.fmean(valid))
        assert _isclose(m.var, statistics.variance(valid) if len(valid) > 1 else 0.0)
    torch.testing.assert_close(
        whiten_with(values=values, mask=mask, stats=m),
        masked_whiten(values=values, mask=mask),
        **F64,
    )
    fixed = whiten_with(values=values, mask=mask, stats=m._replace(mean=0.5, var=4.0))
    expected = torch.where(mask.bool(), (values - 0.5) / math.sqrt(4.0 + 1e-8), 0.0)
    torch.testing.assert_close(fixed, expected, **F64)


def test_whiten_with_refuses_unusable_statistics() -> None:
    values, mask = _rand(2, 3, 7), _mask(2, 3, 8)
    stats = masked_moments(values=values, mask=mask)
    for bad in (stats._replace(var=-1.0), stats._replace(mean=math.nan)):
        with pytest.raises(ValueError, match="stats="):
            whiten_with(values=values, mask=mask, stats=bad)


@pytest.mark.parametrize("mode", ["token", "sample"])
@pytest.mark.parametrize("den", [None, 11.0])
def test_aggregate_loss_matches_loop(mode: str, den: float | None) -> None:
    loss, mask = _rand(5, 6, 60), _mask(5, 6, 61)
    mask[2] = 0  # one fully masked sample
    out = aggregate_loss(loss=loss, mask=mask, mode=mode, denominator=den)
    ref = aggregate_loss_loop(loss=loss.tolist(), mask=mask.tolist(), mode=mode, denominator=den)
    assert _isclose(out.item(), float(ref))


@pytest.mark.parametrize("mode", ["token", "sample"])
def test_aggregate_over_chunks_sums_to_full_batch(mode: str) -> None:
    loss, mask = _rand(6, 5, 70), _mask(6, 5, 71)
    den = float(mask.sum()) if mode == "token" else float((mask.sum(1) > 0).sum())
    full = aggregate_loss(loss=loss, mask=mask, mode=mode, denominator=den)
    parts = [
        aggregate_loss(loss=loss[a:b], mask=mask[a:b], mode=mode, denominator=den)
        for a, b in [(0, 1), (1, 4), (4, 6)]
    ]
    assert _isclose(sum(p.item() for p in parts), full.item())


def test_aggregate_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="loss_agg='mean'"):
        aggregate_loss(loss=torch.zeros(1, 2), mask=torch.ones(1, 2), mode="mean")
    with pytest.raises(ValueError, match=r"loss_denominator=0\.0"):
        aggregate_loss(loss=torch.zeros(1, 2), mask=torch.ones(1, 2), mode="token", denominator=0)


def test_check_reward_kl() -> None:
    check_reward_kl(kl_coef=0.0)
    check_reward_kl(kl_coef=0.1, shared=False)
    with pytest.raises(ValueError, match=r"kl_coef=0\.1.*kl_loss_coef"):
        check_reward_kl(kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_loss_coef"):
        check_reward_kl(kl_coef=-0.01, shared=True)


# --------------------------------------------------------------------------- KL directions
#
# Independent values: each KL below is an exact expectation, written out by hand. A batch
# whose tokens repeat in proportion to a distribution p (p = [1/2, 1/4, 1/4]: tokens
# a, a, b, c) turns a masked mean into the expectation under p, so an unbiased per-token
# estimator of KL(p || q) must average to the exact KL(p || q) = sum p log(p / q).

P = [0.5, 0.5, 0.25, 0.25]  # p(token) at each of the four positions (a, a, b, c)
Q = [0.25, 0.25, 0.25, 0.5]  # q(token) at the same positions
KL_P_Q = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(1.0) + 0.25 * math.log(0.25 / 0.5)


def _logs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in probs]], dtype=T64)


def test_approx_kl_is_k3_of_kl_old_to_new() -> None:
    """Tokens come from the OLD policy: approx_kl estimates KL(old || new) with
    ``(ratio - 1) - log(ratio)``, ``ratio = new / old`` (Stable-Baselines3, CleanRL)."""
    zero = torch.zeros(1, 1, dtype=T64)
    one = torch.ones(1, 1, dtype=T64)

    def kl(new: float, old: float) -> float:
        out = policy_loss(
            logprobs=zero + new, old_logprobs=zero + old, advantages=zero, mask=one, eps_clip=0.2
        )
        return out.approx_kl.item()

    assert kl(0.0, -1.0) == pytest.approx(math.e - 2.0, abs=F64_ATOL)  # 0.718...
    assert kl(-1.0, 0.0) == pytest.approx(1.0 / math.e, abs=F64_ATOL)  # 0.368...
    assert kl(-0.3, -0.3) == 0.0
    # the expectation under old = p of the estimator is the exact KL(old || new)
    old, new, mask = _logs(P), _logs(Q), torch.ones(1, 4, dtype=T64)
    out = policy_loss(logprobs=new, old_logprobs=old, advantages=0 * mask, mask=mask, eps_clip=0.2)
    assert out.approx_kl.item() == pytest.approx(KL_P_Q, abs=F64_ATOL)
    _, _, loop_kl = policy_loss_loop(
        logprobs=new.tolist(),
        old_logprobs=old.tolist(),
        advantages=(0 * mask).tolist(),
        mask=mask.tolist(),
        eps_clip=0.2,
    )
    assert loop_kl == pytest.approx(KL_P_Q, abs=F64_ATOL)


def test_kl_penalty_estimates_kl_policy_to_reference() -> None:
    """KL loss against the reference: tokens come from the policy, the estimators are of
    KL(policy || ref); k3 is verl's ``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1``."""
    one = torch.ones(1, 1, dtype=T64)
    lp, ref = 0 * one, -one  # log_r = ref - logp = -1
    assert kl_penalty(logprobs=lp, ref_logprobs=ref, estimator="k3").item() == pytest.approx(
        1.0 / math.e, abs=F64_ATOL
    )
    assert kl_penalty(logprobs=ref, ref_logprobs=lp, estimator="k3").item() == pytest.approx(
        math.e - 2.0, abs=F64_ATOL
    )
    assert kl_penalty(logprobs=lp, ref_logprobs=ref, estimator="k1").item() == 1.0
    assert kl_penalty(logprobs=lp, ref_logprobs=ref, estimator="k2").item() == 0.5
    policy, reference, mask = _logs(P), _logs(Q), torch.ones(1, 4, dtype=T64)
    for estimator in ("k1", "k3"):  # the unbiased ones
        per_token = kl_penalty(logprobs=policy, ref_logprobs=reference, estimator=estimator)
        mean = aggregate_loss(loss=per_token, mask=mask, mode="token").item()
        assert mean == pytest.approx(KL_P_Q, abs=F64_ATOL), estimator


# --------------------------------------------------------------------------- gradients
#
# The vectorised functions against autograd through the plain loops (float64, random
# masked inputs): the loops skip masked positions, so they also pin "masked positions get
# exactly zero gradient".


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _scalars(x: torch.Tensor) -> list[list[torch.Tensor]]:
    """0-d views of a leaf, so the loops build an autograd graph to it."""
    return [[x[b, t] for t in range(x.shape[1])] for b in range(x.shape[0])]


def _grads(loss: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, leaves, allow_unused=False))


@pytest.mark.parametrize(
    ("eps_high", "dual", "agg", "den"),
    [
        pytest.param(None, None, "token", None, id="token"),
        pytest.param(0.28, 3.0, "token", 50.0, id="asymmetric-dual-denominator"),
        pytest.param(None, 2.0, "sample", None, id="sample"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_gradient_matches_loop(
    eps_high: float | None, dual: float | None, agg: str, den: float | None, seed: int
) -> None:
    b, t = 4, 9
    old = _rand(b, t, 100 + seed) - 2.0
    new = _leaf(old + _rand(b, t, 110 + seed, scale=0.5))
    adv = _leaf(_rand(b, t, 120 + seed, scale=2.0))
    mask = _mask(b, t, 130 + seed)
    kw = {"eps_clip": 0.2, "eps_clip_high": eps_high, "dual_clip": dual, "loss_agg": agg}
    out = policy_loss(
        logprobs=new, old_logprobs=old, advantages=adv, mask=mask, denominator=den, **kw
    )
    pg, _, _ = policy_loss_loop(
        logprobs=_scalars(new),
        old_logprobs=old.tolist(),
        advantages=_scalars(adv),
        mask=mask.tolist(),
        denominator=den,
        **kw,
    )
    assert isinstance(pg, torch.Tensor)
    got, want = _grads(out.pg_loss, new, adv), _grads(pg, new, adv)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **F64)
        assert bool((g[mask == 0] == 0).all())
    assert bool((got[0] != 0).any())


@pytest.mark.parametrize("clip", [None, 0.1])
@pytest.mark.parametrize("agg", ["token", "sample"])
def test_value_loss_gradient_matches_loop(clip: float | None, agg: str) -> None:
    b, t = 3, 8
    old = _rand(b, t, 140)
    new = _leaf(old + _rand(b, t, 141, scale=0.4))
    ret = _rand(b, t, 142)
    mask = _mask(b, t, 143)
    out = value_loss(
        values=new, old_values=old, returns=ret, mask=mask, value_clip=clip, loss_agg=agg
    )
    loop, _ = value_loss_loop(
        values=_scalars(new),
        old_values=old.tolist(),
        returns=ret.tolist(),
        mask=mask.tolist(),
        value_clip=clip,
        loss_agg=agg,
    )
    assert isinstance(loop, torch.Tensor)
    (g,), (w,) = _grads(out.v_loss, new), _grads(loop, new)
    torch.testing.assert_close(g, w, **F64)
    assert bool((g[mask == 0] == 0).all()) and bool((g != 0).any())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", ["token", "sample"])
def test_kl_loss_gradient_matches_loop(estimator: str, agg: str) -> None:
    lp, ref, mask = _leaf(_rand(3, 6, 150)), _rand(3, 6, 151), _mask(3, 6, 152)
    per_token = kl_penalty(logprobs=lp, ref_logprobs=ref, estimator=estimator, mask=mask)
    loss = aggregate_loss(loss=per_token, mask=mask, mode=agg)
    loop_tokens = kl_loop(
        logprobs=_scalars(lp), ref_logprobs=ref.tolist(), estimator=estimator, mask=mask.tolist()
    )
    loop = aggregate_loss_loop(loss=loop_tokens, mask=mask.tolist(), mode=agg)
    assert isinstance(loop, torch.Tensor)
    (g,), (w,) = _grads(loss, lp), _grads(loop, lp)
    torch.testing.assert_close(g, w, **F64)
    assert bool((g[mask == 0] == 0).all()) and bool((g != 0).any())


def test_entropy_gradient_matches_loop() -> None:
    logits = _leaf(_rand(4, 7, 160, scale=2.0))
    ent = entropy_from_logits(logits=logits)
    weights = _rand(4, 1, 161).squeeze(1)  # a random linear functional of the entropies
    (g,) = _grads((ent * weights).sum(), logits)
    loop = sum(
        (weights[i] * entropy_loop(logits=[logits[i, v] for v in range(7)]) for i in range(4)),
        start=torch.zeros((), dtype=T64),
    )
    (w,) = _grads(loop, logits)
    torch.testing.assert_close(g, w, **F64)


# --------------------------------------------------------------------------- masked extremes
#
# Whatever a masked position holds (inf, -inf, nan, a log-ratio far beyond float32's exp
# range), the result and every gradient equal those of the same inputs with 0 there, and
# the masked gradient is exactly 0: finite everywhere.

EXTREMES = [
    pytest.param(float("inf"), id="inf"),
    pytest.param(float("-inf"), id="-inf"),
    pytest.param(float("nan"), id="nan"),
    pytest.param(100.0, id="100"),
    pytest.param(-100.0, id="-100"),
    pytest.param(1e30, id="1e30"),
]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(T64, id="f64")]


def test_masked_huge_log_ratio_gives_zero_gradient_not_nan() -> None:
    """The reported case: float32, masked log-ratio 100 (exp overflows): gradient was NaN."""
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -101.0]])
    out = policy_loss(
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([[1.0, 0.0]]),
        mask=torch.tensor([[1.0, 0.0]]),
        eps_clip=0.2,
    )
    out.pg_loss.backward()  # type: ignore[no-untyped-call]
    assert lp.grad is not None
    assert lp.grad[0, 1].item() == 0.0
    # One valid token; its float32 log-ratio -1 - fl(-1.1) is exact (Sterbenz), ratio
    # e^0.1 inside the clip range: d(-A * ratio)/d logp = -ratio. float32 exp / expm1 are
    # within 2 ulp; the k3 subtraction expm1(x) - x is exact (Sterbenz again).
    x = float((lp[0, 0] - old[0, 0]).item())
    ratio = math.exp(x)
    assert lp.grad[0, 0].item() == pytest.approx(-ratio, rel=2 * EPS[torch.float32], abs=0)
    kl = math.expm1(x) - x
    assert out.approx_kl.item() == pytest.approx(kl, abs=2 * math.expm1(x) * EPS[torch.float32])


def _poison(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def _check_masked_extreme(
    fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    value: float,
    *,
    grad_of: Sequence[str],
) -> None:
    clean = {k: _leaf(v) if k in grad_of else v for k, v in inputs.items()}
    dirty = {
        k: _leaf(_poison(v, mask, value)) if k in grad_of else _poison(v, mask, value)
        for k, v in inputs.items()
    }
    out_clean, out_dirty = fn(clean), fn(dirty)
    torch.testing.assert_close(out_dirty, out_clean, rtol=0, atol=0)
    g_clean = _grads(out_clean, *(clean[k] for k in grad_of))
    g_dirty = _grads(out_dirty, *(dirty[k] for k in grad_of))
    for name, gc, gd in zip(grad_of, g_clean, g_dirty, strict=True):
        assert bool(torch.isfinite(gd).all()), f"{name}: non-finite gradient"
        assert bool((gd[mask == 0] == 0).all()), f"{name}: gradient at a masked position"
        torch.testing.assert_close(gd, gc, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_masked_extremes(value: float, dtype: torch.dtype, dual: float | None) -> None:
    b, t = 3, 6
    mask = _mask(b, t, 170)
    inputs = {
        "logprobs": (_rand(b, t, 171) - 2.0).to(dtype),
        "old_logprobs": (_rand(b, t, 172) - 2.0).to(dtype),
        "advantages": _rand(b, t, 173).to(dtype),
    }

    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        out = policy_loss(
            logprobs=x["logprobs"],
            old_logprobs=x["old_logprobs"],
            advantages=x["advantages"],
            mask=mask.to(dtype),
            eps_clip=0.2,
            dual_clip=dual,
        )
        assert bool(torch.isfinite(out.approx_kl)) and bool(torch.isfinite(out.clipfrac))
        return out.pg_loss

    _check_masked_extreme(fn, inputs, mask, value, grad_of=("logprobs", "advantages"))


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", ["token", "sample"])
def test_value_loss_masked_extremes(value: float, dtype: torch.dtype, agg: str) -> None:
    b, t = 3, 6
    mask = _mask(b, t, 180)
    inputs = {
        "values": _rand(b, t, 181).to(dtype),
        "old_values": _rand(b, t, 182).to(dtype),
        "returns": _rand(b, t, 183).to(dtype),
    }

    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return value_loss(
            values=x["values"],
            old_values=x["old_values"],
            returns=x["returns"],
            mask=mask.to(dtype),
            value_clip=0.2,
            loss_agg=agg,
        ).v_loss

    _check_masked_extreme(fn, inputs, mask, value, grad_of=("values", "old_values", "returns"))


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_masked_extremes(value: float, dtype: torch.dtype, estimator: str) -> None:
    b, t = 3, 6
    mask = _mask(b, t, 190)
    inputs = {
        "logprobs": (_rand(b, t, 191) - 2.0).to(dtype),
        "ref_logprobs": (_rand(b, t, 192) - 2.0).to(dtype),
    }

    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        per_token = kl_penalty(
            logprobs=x["logprobs"],
            ref_logprobs=x["ref_logprobs"],
            estimator=estimator,
            mask=mask.to(dtype),
        )
        return aggregate_loss(loss=per_token, mask=mask.to(dtype), mode="token")

    _check_masked_extreme(fn, inputs, mask, value, grad_of=("logprobs", "ref_logprobs"))


@pytest.mark.parametrize("value", EXTREMES)
def test_aggregate_and_whiten_masked_extremes(value: float) -> None:
    mask = _mask(4, 5, 200)
    for mode in ("token", "sample"):
        _check_masked_extreme(
            lambda x, mode=mode: aggregate_loss(loss=x["loss"], mask=mask, mode=mode),
            {"loss": _rand(4, 5, 201)},
            mask,
            value,
            grad_of=("loss",),
        )
    _check_masked_extreme(
        lambda x: (masked_whiten(values=x["v"], mask=mask) * _rand(4, 5, 202)).sum(),
        {"v": _rand(4, 5, 203)},
        mask,
        value,
        grad_of=("v",),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_unmasked_extreme_log_ratio_is_clamped(dtype: torch.dtype) -> None:
    """|log-ratio| > MAX_LOG_RATIO on a VALID token (float32 exp would overflow at ~88.7):
    finite loss and gradients; the ratio saturates at exp(+-MAX_LOG_RATIO) and that
    token passes no gradient through it (verl's clamp)."""
    lp = torch.tensor([[0.0, 0.0, 0.0, -0.5]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-100.0, 100.0, -25.0, -0.4]], dtype=dtype)
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0]], dtype=dtype)
    mask = torch.ones(1, 4, dtype=dtype)
    out = policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, eps_clip=0.2)
    big = math.exp(MAX_LOG_RATIO)
    # per token: e^20 (saturated), -(1 - 0.2) * -1 -> max(e^-20, 0.8) = 0.8, e^20, -e^-0.1.
    # Relative error: exp within 2 ulp, then three rounded additions: < 8 eps.
    rel = 8 * EPS[dtype]
    expected = (big + 0.8 + big - math.exp(-0.1)) / 4
    assert out.pg_loss.item() == pytest.approx(expected, rel=rel)
    assert math.isfinite(out.approx_kl.item())
    assert out.approx_kl.item() == pytest.approx(
        (
            2 * (big - 1 - MAX_LOG_RATIO)
            + (math.exp(-MAX_LOG_RATIO) - 1 + MAX_LOG_RATIO)
            + (math.expm1(-0.1) + 0.1)
        )
        / 4,
        rel=rel,
    )
    out.pg_loss.backward()  # type: ignore[no-untyped-call]
    assert lp.grad is not None and bool(torch.isfinite(lp.grad).all())
    assert lp.grad[0, :3].tolist() == [0.0, 0.0, 0.0]  # saturated or clipped
    assert lp.grad[0, 3].item() == pytest.approx(-math.exp(-0.1) / 4, rel=rel)
    kl = kl_penalty(
        logprobs=lp, ref_logprobs=old, estimator="k3", mask=mask
    )  # log_r = old - lp: -100, 100, -25, 0.1
    assert bool(torch.isfinite(kl).all())
    (g,) = _grads(kl.sum(), lp)
    assert bool(torch.isfinite(g).all()) and g[0, :3].tolist() == [0.0, 0.0, 0.0]


def test_entropy_with_minus_inf_logits_is_finite() -> None:
    """A vocabulary mask (-inf logits) used to give 0 * -inf = nan in the entropy and its
    gradient; the masked entries have p = 0 and contribute nothing."""
    finite = _rand(2, 3, 210)
    logits = torch.cat([finite, torch.full((2, 2), float("-inf"), dtype=T64)], dim=1)
    x = _leaf(logits)
    ent = entropy_from_logits(logits=x)
    torch.testing.assert_close(ent, entropy_from_logits(logits=finite), **F64)
    (g,) = _grads(ent.sum(), x)
    assert bool(torch.isfinite(g).all()) and bool((g[:, 3:] == 0).all())
    y = _leaf(finite)
    (g_ref,) = _grads(entropy_from_logits(logits=y).sum(), y)
    torch.testing.assert_close(g[:, :3], g_ref, **F64)
    for i in range(2):
        assert _isclose(ent[i].item(), float(entropy_loop(logits=logits[i].tolist())))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_logits_are_upcast_but_float64_is_kept(half: torch.dtype) -> None:
    logits = _rand(2, 5, 220)
    labels = torch.tensor([1, 3])
    assert entropy_from_logits(logits=logits).dtype == T64
    assert logprobs_from_logits(logits=logits, labels=labels).dtype == T64
    assert entropy_from_logits(logits=logits.to(half)).dtype == torch.float32
    assert logprobs_from_logits(logits=logits.to(half), labels=labels).dtype == torch.float32
