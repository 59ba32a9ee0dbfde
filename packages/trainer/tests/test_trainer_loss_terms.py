"""The actor's and the critic's losses as the workers put them together, against the
documented formulas written out here (not against a second worker, which would share a
bug): the policy loss plus ``kl_loss_coef`` times the KL loss minus ``entropy_coef`` times
the entropy, each aggregated like the policy loss; the critic's clipped value loss on
its SHIFTED values (position t read from the state before token t).

Tolerances: the actor's terms are float64 sums of a few dozen tokens (1e-12 relative
is far above their rounding); the critic runs in float32, and its loss here is 0.5 times
a mean of squares of O(0.1) differences read back from the same forward: rounding of
float32 values of O(1) is about 1e-7 absolute per value, so 1e-6 relative to a loss of
O(1e-3) bounds it with margin, while the bugs these catch move it by O(1).
"""

from __future__ import annotations

import pytest
import torch
from ppo_trainer import ActorConfig, CriticWorker
from ppo_trainer._actor_loss import actor_loss
from ppo_trainer._actor_step import StepSums, chunk_metrics, final_denominator, update_metrics
from ppo_trainer._batching import check_batch, shift
from ppo_trainer._kept_chunks import KeptChunks
from ppo_trainer._math import policy_loss, value_loss
from trainer_testlib import TINY, critic_config, make_data


def test_shift_moves_native_positions_one_token_right() -> None:
    assert shift(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[0.0, 1.0, 2.0]]


def _expected_actor_loss(
    logits: torch.Tensor, mb: dict[str, torch.Tensor], cfg: ActorConfig, den: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total loss, KL loss, entropy loss) by the formulas, token by token."""
    ids, mask = mb["input_ids"], mb["loss_mask"]
    b, t = ids.shape
    pg = torch.zeros(b, t, dtype=logits.dtype)
    kl = torch.zeros(b, t, dtype=logits.dtype)
    ent = torch.zeros(b, t, dtype=logits.dtype)
    for i in range(b):
        for j in range(1, t):  # token j is predicted from position j - 1
            logp = torch.log_softmax(logits[i, j - 1], dim=-1)
            lp = logp[ids[i, j]]
            ent[i, j] = -(logp.exp() * logp).sum()
            ratio = torch.exp(lp - mb["old_logprobs"][i, j])
            adv = mb["advantages"][i, j]
            clipped = torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip)
            pg[i, j] = torch.maximum(-adv * ratio, -adv * clipped)
            log_r = mb["ref_logprobs"][i, j] - lp  # log(ref / pi): KL(pi || ref)
            kl[i, j] = -log_r if cfg.kl_estimator == "k1" else torch.expm1(log_r) - log_r

    def agg(x: torch.Tensor) -> torch.Tensor:
        if cfg.loss_agg == "token":
            return (x * mask).sum() / den
        per_row = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_row.sum() / den

    total = agg(pg) + cfg.kl_loss_coef * agg(kl) - cfg.entropy_coef * agg(ent)
    return total, agg(kl), agg(ent)


@pytest.mark.parametrize("loss_agg", ["token", "sample"])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_actor_loss_is_policy_plus_kl_minus_entropy(loss_agg: str, estimator: str) -> None:
    g = torch.Generator().manual_seed(0)
    b, t, vocab = 3, 6, 7
    mask = torch.tensor(
        [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0]], dtype=torch.float64
    )
    mb = {
        "input_ids": torch.randint(0, vocab, (b, t), generator=g),
        "loss_mask": mask,
        "advantages": torch.randn(b, t, generator=g, dtype=torch.float64) * mask,
        "old_logprobs": (torch.randn(b, t, generator=g, dtype=torch.float64) - 2.0) * mask,
        "ref_logprobs": (torch.randn(b, t, generator=g, dtype=torch.float64) - 2.0) * mask,
    }
    cfg = ActorConfig(
        model=TINY,
        kl_loss_coef=0.05,
        kl_estimator=estimator,
        entropy_coef=0.01,
        loss_agg=loss_agg,
    )
    den = float(mask.sum()) if loss_agg == "token" else float(b)
    logits = torch.randn(b, t, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    loss, sums = actor_loss(logits, dict(mb), config=cfg, denominator=den)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    want, want_kl, want_ent = _expected_actor_loss(ref_logits, mb, cfg, den)
    (want_grad,) = torch.autograd.grad(want, ref_logits)
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    # the reported terms are the aggregated KL and entropy, without their coefficients
    assert sums["kl"] == pytest.approx(want_kl.item(), rel=1e-12)
    assert sums["entropy"] == pytest.approx(want_ent.item(), rel=1e-12)


@pytest.mark.parametrize("loss_agg", ["token", "sample"])
def test_critic_loss_reads_the_shifted_values(loss_agg: str) -> None:
    """Returns set to the critic's own values plus a known offset per row: the first
    update's loss is ``0.5 * offset**2`` aggregated (before that update the weights are
    the ones that produced the values), whatever positions hold the response."""
    data = make_data(4, 10, seed=3)
    critic = CriticWorker(critic_config("torch", value_clip=None, loss_agg=loss_agg))
    values = critic.compute_values(data.batch)
    mask = data.batch["loss_mask"]
    offset = torch.tensor([0.1, 0.2, 0.3, 0.4])[:, None]
    out = critic.train(
        data.batch,
        returns=(values + offset) * mask,
        old_values=values,
        epochs=1,
        mini_batch_size=4,
    )
    per_token = 0.5 * offset**2 * torch.ones_like(mask)
    if loss_agg == "token":
        want = float((per_token * mask).sum() / mask.sum())
    else:
        rows = (per_token * mask).sum(dim=1) / mask.sum(dim=1)
        want = float(rows.mean())
    assert out["loss/value"] == pytest.approx(want, rel=1e-6)
    assert out["critic/optimizer_steps"] == 1


def test_loss_functions_refuse_clips_that_cannot_work() -> None:
    """A dual clip must exceed 1 (at 1 it would clip every negative advantage's loss to
    the advantage itself) and a value clip must be positive (0 freezes the values)."""
    x = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(
            logprobs=x, old_logprobs=x, advantages=x, mask=mask, eps_clip=0.2, dual_clip=1.0
        )
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(values=x, old_values=x, returns=x, mask=mask, value_clip=0.0)


# --------------------------------------------------------------- a step's bookkeeping


def test_a_refused_chunk_denominator_leaves_the_step_unopened() -> None:
    step = StepSums()
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="loss_denominator"):
            step.use_denominator(bad, loss_agg="token")
    assert step.denominator is None
    step.use_denominator(12, loss_agg="token")
    with pytest.raises(ValueError, match="differs"):
        step.use_denominator(12.5, loss_agg="token")


@pytest.mark.parametrize(
    ("loss_agg", "good", "bad"),
    [
        # token: only the step's valid-token count (rows are not tokens)
        ("token", [10.0], [4.0, 10.5, 10.001]),
        # sample: the samples with a valid token, or all rows (both documented)
        ("sample", [3.0, 4.0], [5.0, 3.01, 10.0]),
    ],
)
def test_the_final_denominator_must_be_the_steps_count(
    loss_agg: str, good: list[float], bad: list[float]
) -> None:
    totals = {"tokens": 10.0, "samples": 3.0, "rows": 4.0}
    for given in good:
        assert final_denominator(totals, provisional=1.0, given=given, loss_agg=loss_agg) == given
    for given in bad:
        with pytest.raises(ValueError, match="does not match"):
            final_denominator(totals, provisional=1.0, given=given, loss_agg=loss_agg)


def test_step_metrics_are_token_weighted_and_rescaled() -> None:
    """Clip fraction and approx KL are per valid token (their sums carry the token
    weight); the loss terms are rescaled to the final denominator, the KL's too."""
    cfg = ActorConfig(model=TINY, kl_loss_coef=0.1, entropy_coef=0.01)
    step = StepSums()
    results = [  # two micro-batches: 3 and 5 valid tokens
        {"pg": 0.5, "kl": 0.2, "entropy": 1.0, "clipfrac": 0.5 * 3, "approx_kl": 0.01 * 3},
        {"pg": 0.25, "kl": 0.1, "entropy": 2.0, "clipfrac": 0.2 * 5, "approx_kl": 0.03 * 5},
    ]
    summed = step.add(results, tokens=8.0, samples=2.0)
    chunk = chunk_metrics(tokens=8.0, summed=summed, config=cfg, engine=False)
    assert chunk["actor/clipfrac"] == pytest.approx((1.5 + 1.0) / 8)
    assert chunk["actor/approx_kl"] == pytest.approx((0.03 + 0.15) / 8)
    totals = step.totals(lambda xs: list(xs))
    out = update_metrics(
        totals, {"grad_norm": 1.0, "lr": 1e-3}, scale=0.5, global_step=1, config=cfg
    )
    assert out["actor/clipfrac"] == pytest.approx(2.5 / 8)
    assert out["actor/approx_kl"] == pytest.approx(0.18 / 8)
    assert out["loss/pg"] == pytest.approx(0.75 * 0.5)
    assert out["loss/kl"] == pytest.approx(0.3 * 0.5)
    assert out["loss/entropy"] == pytest.approx(3.0 * 0.5)


def test_kept_chunks_count_samples_and_rows_apart() -> None:
    kept = KeptChunks()
    kept.add_rows(3)
    kept.add_rows(3)  # a second chunk: rows add up
    kept.add([{"x": torch.zeros(2)}], tokens=7.0, samples=2.0)  # one row fully masked
    kept.add([{"x": torch.zeros(3)}], tokens=4.0, samples=3.0)
    assert kept.counts == {"tokens": 11.0, "samples": 5.0, "rows": 6.0}


@pytest.mark.parametrize("name", ["advantages", "old_logprobs", "ref_logprobs"])
def test_a_per_token_input_of_another_width_is_refused_by_name(name: str) -> None:
    batch = make_data(2, 5).batch
    with pytest.raises(ValueError, match=name):
        check_batch(batch, ("input_ids",), **{name: torch.zeros(2, 4)})


def test_a_critic_mini_batch_without_valid_tokens_takes_no_step() -> None:
    """Mini-batches of the step's order in which every row is masked make no optimizer
    update (nothing to learn; Adam would still move the weights on zero gradients)."""
    data = make_data(4, 8, seed=1)
    batch = dict(data.batch)
    batch["loss_mask"] = batch["loss_mask"].clone()
    batch["loss_mask"][2:] = 0  # the second mini-batch of 2 is all masked
    critic = CriticWorker(critic_config("torch"))
    values = critic.compute_values(batch)
    before = {k: v.clone() for k, v in critic.export_weights().items()}
    out = critic.train(batch, returns=values * 0, old_values=values, epochs=1, mini_batch_size=2)
    assert out["critic/optimizer_steps"] == 1
    assert any(not torch.equal(before[k], v) for k, v in critic.export_weights().items())


def test_critic_micro_batches_without_valid_tokens_are_not_run_or_counted() -> None:
    """A masked row alone in its micro-batch (micro-batches of 1) is not run, so the
    ``value_forward_backward`` counter counts the rows that were: 3 of 4, twice."""
    data = make_data(4, 8, seed=2)
    batch = dict(data.batch)
    batch["loss_mask"] = batch["loss_mask"].clone()
    batch["loss_mask"][1] = 0
    critic = CriticWorker(critic_config("torch", micro_batch_size=1))
    values = critic.compute_values(batch)
    critic.train(batch, returns=values * 0, old_values=values, epochs=2, mini_batch_size=2)
    assert critic.counters() == {"value_forward": 4, "value_forward_backward": 6}


def test_critic_metrics_average_the_updates_and_weight_clipping_by_tokens() -> None:
    """Two epochs of two mini-batches with a learning rate too small to move float32
    weights (1e-30), so every update sees the first values V: with returns V + 0.1 and
    old values V - 0.5 on rows 0 and 2 (beyond the clip of 0.2), V on rows 1 and 3,
    each update's loss is 0.5 * max((V - R)^2, (V_clip - R)^2) over its valid tokens,
    ``loss/value`` their mean over the 4 updates, and ``critic/clipfrac`` the share of
    valid tokens clipped over all of them (rows 0 and 2's tokens)."""
    data = make_data(4, 12, seed=5)
    mask = data.batch["loss_mask"]
    critic = CriticWorker(critic_config("torch", lr=1e-30, value_clip=0.2))
    values = critic.compute_values(data.batch)
    shift_old = torch.tensor([0.5, 0.0, 0.5, 0.0])[:, None]
    out = critic.train(
        data.batch,
        returns=(values + 0.1) * mask,
        old_values=(values - shift_old) * mask,
        epochs=2,
        mini_batch_size=2,
    )
    # per token: unclipped 0.1^2; clipped rows: V_clip = V - 0.3, so (0.3 + 0.1)^2
    per_token = 0.5 * torch.where(shift_old > 0, 0.4**2, 0.1**2) * torch.ones_like(mask)
    updates = [
        float((per_token[r] * mask[r]).sum() / mask[r].sum()) for r in (slice(0, 2), slice(2, 4))
    ]
    assert out["critic/optimizer_steps"] == 4
    assert out["loss/value"] == pytest.approx(sum(updates) / 2, rel=1e-5)
    clipped = float(mask[0].sum() + mask[2].sum())
    assert out["critic/clipfrac"] == pytest.approx(clipped / float(mask.sum()), rel=1e-6)
