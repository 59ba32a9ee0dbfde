"""PPO math: vectorised functions against the plain-loop references, and the pinned GAE."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_trainer import (
    aggregate_loss,
    check_reward_kl,
    entropy_from_logits,
    gae,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
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

T64 = torch.float64


def _t(grid: list[list[float]]) -> torch.Tensor:
    return torch.tensor(grid, dtype=T64)


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
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, torch.where(mask.bool(), expected_adv + values, 0 * values))


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
    torch.testing.assert_close(adv, _t(ra))
    torch.testing.assert_close(ret, _t(rr))
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
    torch.testing.assert_close(adv, _t(ra))
    torch.testing.assert_close(ret, _t(rr))


def test_gae_ignores_masked_rewards_and_values() -> None:
    rewards, values, mask = _rand(3, 8, 5), _rand(3, 8, 6), _mask(3, 8, 7)
    noise = torch.where(mask.bool(), torch.zeros_like(values), _rand(3, 8, 8) * 100)
    a1, r1 = gae(rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.8)
    a2, r2 = gae(rewards=rewards + noise, values=values - noise, mask=mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)


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
        gae(**args)  # type: ignore[arg-type]


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
    assert math.isclose(out.pg_loss.item(), pg, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(out.clipfrac.item(), cf, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(out.approx_kl.item(), kl, rel_tol=1e-9, abs_tol=1e-12)
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
    assert plain.pg_loss.item() == pytest.approx(math.exp(3.0))
    assert dual.pg_loss.item() == pytest.approx(3.0)


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
    assert math.isclose(out.v_loss.item(), loss, rel_tol=1e-9)
    assert math.isclose(out.clipfrac.item(), cf, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_loop(estimator: str) -> None:
    lp, ref = _rand(3, 5, 30), _rand(3, 5, 31)
    out = kl_penalty(logprobs=lp, ref_logprobs=ref, estimator=estimator)
    torch.testing.assert_close(
        out, _t(kl_loop(logprobs=lp.tolist(), ref_logprobs=ref.tolist(), estimator=estimator))
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
            assert math.isclose(
                ent[i, j].item(), entropy_loop(logits=logits[i, j].tolist()), rel_tol=1e-5
            )
    labels = torch.tensor([[0, 4, 2], [1, 1, 3]])
    lp = logprobs_from_logits(logits=logits, labels=labels)
    torch.testing.assert_close(
        lp,
        torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1),
    )


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 4), t=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_masked_mean_and_whiten_match_loop(b: int, t: int, seed: int) -> None:
    values, mask = _rand(b, t, seed, scale=3.0) + 1.0, _mask(b, t, seed)
    assert math.isclose(
        masked_mean(values=values, mask=mask).item(),
        masked_mean_loop(values=values.tolist(), mask=mask.tolist()),
        rel_tol=1e-9,
        abs_tol=1e-12,
    )
    torch.testing.assert_close(
        masked_whiten(values=values, mask=mask),
        _t(masked_whiten_loop(values=values.tolist(), mask=mask.tolist())),
    )


def test_masked_whiten_statistics() -> None:
    values, mask = _rand(4, 16, 50, scale=5.0) + 3.0, _mask(4, 16, 51)
    w = masked_whiten(values=values, mask=mask)
    picked = w[mask.bool()]
    assert abs(picked.mean().item()) < 1e-9
    assert picked.std().item() == pytest.approx(1.0, rel=1e-6)
    shifted = masked_whiten(values=values, mask=mask, shift_mean=False)
    assert shifted[mask.bool()].mean().item() == pytest.approx(values[mask.bool()].mean().item())


@pytest.mark.parametrize("mode", ["token", "sample"])
@pytest.mark.parametrize("den", [None, 11.0])
def test_aggregate_loss_matches_loop(mode: str, den: float | None) -> None:
    loss, mask = _rand(5, 6, 60), _mask(5, 6, 61)
    mask[2] = 0  # one fully masked sample
    out = aggregate_loss(loss=loss, mask=mask, mode=mode, denominator=den)
    ref = aggregate_loss_loop(loss=loss.tolist(), mask=mask.tolist(), mode=mode, denominator=den)
    assert math.isclose(out.item(), ref, rel_tol=1e-9)


@pytest.mark.parametrize("mode", ["token", "sample"])
def test_aggregate_over_chunks_sums_to_full_batch(mode: str) -> None:
    loss, mask = _rand(6, 5, 70), _mask(6, 5, 71)
    den = float(mask.sum()) if mode == "token" else float((mask.sum(1) > 0).sum())
    full = aggregate_loss(loss=loss, mask=mask, mode=mode, denominator=den)
    parts = [
        aggregate_loss(loss=loss[a:b], mask=mask[a:b], mode=mode, denominator=den)
        for a, b in [(0, 1), (1, 4), (4, 6)]
    ]
    assert math.isclose(sum(p.item() for p in parts), full.item(), rel_tol=1e-12)


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
