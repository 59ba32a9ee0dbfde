"""The worker contract, run once per registered backend (the ``backend`` fixture).

Streaming equivalence (any chunking, one or two data-parallel ranks), gradients kept
through a keep-gradients sleep, frozen critic targets, HF and checkpoint round trips,
masked chunks and steps, lifecycle idempotence.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.multiprocessing as mp
from ppo_lifecycle import KEEP_GRADIENTS, Part
from ppo_trainer import (
    ActorWorker,
    CriticWorker,
    EmptyStepError,
    ModelSpec,
    aggregate_loss,
    loss_denominator,
    masked_whiten,
    save_hf_checkpoint,
)
from safetensors.torch import load_file, save_file
from trainer_testlib import (
    TINY,
    PPOData,
    actor_config,
    adam_step_bound,
    assert_within,
    critic_config,
    grad_bounds,
    head_magnitude,
    hf_named,
    make_data,
    model_terms,
    norm_bound,
    rounding_bound,
    with_model_inputs,
)

# Tolerances: float32 tiny models, so a chunked and a full-batch run differ by rounding
# only, and every comparison below is bounded by what is compared (trainer_testlib's
# docstring): gradients by ``rounding_bound`` over the step's accumulation chain
# (``model_terms``) and the tensor's accumulated magnitude; weights after the one Adam
# step by ``adam_step_bound``; computations repeated in the same order are compared
# exactly (same kernels on the same shapes: bit-identical on any CPU).


def _with_key(key: str, message: str) -> str:
    return f"{key}: {message}"


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: Any) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=partial(_with_key, k), **tol)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def prepared(backend: str, *, b: int = 6, seed: int = 0, **actor_kw: Any) -> PPOData:
    """Data whose old log-probs / values come from the initial models."""
    data = make_data(b, seed=seed)
    actor = ActorWorker(actor_config(backend, **actor_kw))
    critic = CriticWorker(critic_config(backend))
    return with_model_inputs(
        data, actor.compute_logprobs(data.batch), critic.compute_values(data.batch)
    )


class ActorStep(NamedTuple):
    """One actor step: the summed gradients before the update (HF names), the
    elementwise sum of the chunks' absolute contributions (the magnitude that bounds the
    accumulation's rounding), and ``finish_step``'s metrics."""

    grads: dict[str, torch.Tensor]
    magnitude: dict[str, torch.Tensor]
    metrics: dict[str, float]


def train_chunks(
    worker: ActorWorker,
    data: PPOData,
    chunks: list[list[int]],
    *,
    den: float,
    ref: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``train_chunk`` per chunk; returns the accumulated gradients and their magnitude (the
    elementwise sum of the chunks' absolute contributions), both under HF names."""
    grads: dict[str, torch.Tensor] = {}
    magnitude: dict[str, torch.Tensor] = {}
    for rows in chunks:
        part = data.rows(rows)
        worker.train_chunk(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            ref_logprobs=None if ref is None else ref[rows],
            loss_denominator=den,
        )
        now = hf_named(worker, worker.grads())
        for k, g in now.items():
            added = (g - grads[k]).abs() if k in grads else g.abs()
            magnitude[k] = magnitude[k] + added if k in magnitude else added
        grads = now
    return grads, magnitude


def run_actor(
    worker: ActorWorker, data: PPOData, chunks: list[list[int]], *, loss_agg: str
) -> ActorStep:
    """``train_chunk`` per chunk, then one finish_step."""
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg=loss_agg)
    ref = worker.compute_ref_logprobs(data.batch) if worker.config.use_reference else None
    grads, magnitude = train_chunks(worker, data, chunks, den=den, ref=ref)
    return ActorStep(grads, magnitude, worker.finish_step())


def step_terms(data: PPOData) -> int:
    b, t = data.batch["input_ids"].shape
    return model_terms(TINY, tokens=b * t, seq_len=t)


def assert_same_step(
    a: ActorStep,
    b: ActorStep,
    *,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
    terms: int,
    config: Any,
) -> dict[str, float]:
    """Two runs of one actor step that differ only in rounding: gradients within the
    derived per-tensor bound, weights after the Adam step within ``adam_step_bound``.
    Returns the gradient bounds."""
    magnitude = {k: torch.maximum(a.magnitude[k], b.magnitude[k]) for k in a.magnitude}
    bounds = grad_bounds(magnitude, terms=terms)
    assert_within(b.grads, a.grads, bounds)
    moved = adam_step_bound(
        grads=a.grads,
        grad_bound=bounds,
        params=weights_a,
        lr=a.metrics["actor/lr"],
        adam_eps=config.adam_eps,
        grad_norm=a.metrics["actor/grad_norm"],
        max_grad_norm=config.max_grad_norm,
    )
    assert_within(weights_b, weights_a, moved)
    return bounds


def pg_magnitude(logprobs: torch.Tensor, data: PPOData, *, loss_agg: str) -> float:
    """Upper bound of the policy loss's aggregated absolute per-token terms:
    ``|l| <= |A| * max(ratio, 1 + eps_clip)`` (eps_clip = 0.2), aggregated like the loss."""
    mask = data.batch["loss_mask"].double()
    ratio = torch.exp(logprobs.double() - data.old_logprobs.double())
    per_token = data.advantages.double().abs() * ratio.clamp(min=1.2)
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg=loss_agg)
    return float(aggregate_loss(loss=per_token, mask=mask, mode=loss_agg, denominator=den))


def split(sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([1, 5], id="1+5"),
        pytest.param([2, 2, 2], id="2+2+2"),
        pytest.param([4, 1, 1], id="4+1+1"),
        pytest.param([1, 1, 1, 1, 1, 1], id="6x1"),
    ],
)
@pytest.mark.parametrize("loss_agg", ["token", "sample"])
def test_streaming_equivalence(backend: str, sizes: list[int], loss_agg: str) -> None:
    kw: dict[str, Any] = {"loss_agg": loss_agg, "kl_loss_coef": 0.05, "entropy_coef": 0.01}
    data = prepared(backend, **kw)
    full, chunked = (
        ActorWorker(actor_config(backend, **kw)),
        ActorWorker(actor_config(backend, **kw)),
    )
    logprobs = full.compute_logprobs(data.batch)  # the weights of both runs' forward
    s_full = run_actor(full, data, [list(range(6))], loss_agg=loss_agg)
    s_chunk = run_actor(chunked, data, split(sizes), loss_agg=loss_agg)
    m_full, m_chunk = s_full.metrics, s_chunk.metrics
    assert max(float(g.abs().max()) for g in s_full.grads.values()) > 1e-3  # a real gradient
    assert 0 < m_full["actor/clipfrac"] < 1  # the clipped branch is exercised
    bounds = assert_same_step(
        s_full,
        s_chunk,
        weights_a=full.export_weights(),
        weights_b=chunked.export_weights(),
        terms=step_terms(data),
        config=full.config,
    )
    # Loss metrics: aggregates of per-token values whose float32 error is relative to the
    # log-probs' scale: bounded per token by |A| * max(ratio, 1 + eps) (pg), log V
    # (entropy), 1 (k3 of a log-ratio near 0), times (1 + max |log-prob|).
    mask = data.batch["loss_mask"].double()
    scale = 1.0 + float(logprobs[mask.bool()].abs().max())
    terms = model_terms(TINY, tokens=mask.numel(), seq_len=mask.shape[1], backward=False)
    magnitudes = {
        "loss/pg": pg_magnitude(logprobs, data, loss_agg=loss_agg) * scale,
        "loss/entropy": math.log(TINY.vocab_size) * scale,
        "loss/kl": scale,
    }
    for key, magnitude in magnitudes.items():
        bound = rounding_bound(terms=terms, magnitude=magnitude)
        assert abs(m_chunk[key] - m_full[key]) <= bound, key
    assert abs(m_chunk["actor/grad_norm"] - m_full["actor/grad_norm"]) <= norm_bound(
        s_full.grads, bounds
    )
    # clipfrac: per micro-batch count / n * n in float32, summed over micro-batches
    assert abs(m_chunk["actor/clipfrac"] - m_full["actor/clipfrac"]) <= rounding_bound(
        terms=2 + 6, magnitude=m_full["actor/clipfrac"]
    )
    assert m_full["actor/valid_tokens"] == data.batch["loss_mask"].sum().item()


def test_streaming_chunk_is_its_own_old_policy(backend: str) -> None:
    """``train_chunk`` without ``old_logprobs`` / ``ref_logprobs`` (streaming, one policy
    epoch, KL loss on): the old log-probs are this forward's, detached (ratio exactly 1),
    no separate log-prob forward runs, the reference forward runs inside the call. The
    same micro-batches through the same kernels as passing ``compute_logprobs`` /
    ``compute_ref_logprobs`` of the same weights: bit-identical gradients and metrics."""
    kw: dict[str, Any] = {"kl_loss_coef": 0.05, "entropy_coef": 0.01}
    data = make_data(6)
    mask = data.batch["loss_mask"]
    den = loss_denominator(loss_mask=mask, loss_agg="token")
    streamed = ActorWorker(actor_config(backend, **kw))
    given = ActorWorker(actor_config(backend, **kw))
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    engine = (given.compute_logprobs(data.batch) + 0.1 * noise) * mask
    for rows in split([2, 4]):
        part = data.rows(rows)
        m_stream = streamed.train_chunk(
            part.batch,
            advantages=part.advantages,
            loss_denominator=den,
            engine_logprobs=engine[rows],
        )
        old = given.compute_logprobs(part.batch)  # no optimizer step yet: same weights
        m_given = given.train_chunk(
            part.batch,
            advantages=part.advantages,
            loss_denominator=den,
            old_logprobs=old,
            ref_logprobs=given.compute_ref_logprobs(part.batch),
            engine_logprobs=engine[rows],
        )
        assert m_stream == m_given
        assert m_stream["actor/clipfrac"] == m_stream["actor/approx_kl"] == 0.0  # ratio 1
        assert m_stream["loss/pg"] != 0.0 and m_stream["loss/kl"] == 0.0  # ref == policy
        # k3 of d = old - engine, summed over the valid tokens, against the formula in
        # float64: rounding of a few operations per token and of the sum, relative to the
        # terms before cancellation (exp(d), 1, |d|)
        valid = part.batch["loss_mask"].bool()
        d = (old.double() - engine[rows].double())[valid]
        expected = float((torch.exp(d) - 1 - d).sum())
        bound = rounding_bound(
            terms=d.numel() + 4,
            magnitude=float((torch.exp(d) + 1 + d.abs()).sum()),
            dtype=torch.float64,
        )
        assert abs(m_stream["rollout/kl_engine_trainer_sum"] - expected) <= bound
        assert expected > 0
    assert_states_close(streamed.grads(), given.grads(), rtol=0, atol=0)
    assert streamed.counters() == {
        "policy_forward": 0,  # no separate log-prob forward
        "policy_forward_backward": 6,
        "reference_forward": 6,  # inside train_chunk
    }
    assert given.counters() == {
        "policy_forward": 12,  # the engine stand-in + the old log-probs
        "policy_forward_backward": 6,
        "reference_forward": 6,
    }


TINY_PARAMS_MIN = range(4)  # the tiny model has more than a handful of tensors


def _flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor (numbers as 0-d tensors) of a nested checkpoint state, by path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, int | float) and not isinstance(state, bool):
        return {prefix: torch.tensor(float(state), dtype=torch.float64)}
    items: Any = (
        state.items()
        if isinstance(state, dict)
        else enumerate(state)
        if isinstance(state, list | tuple)
        else ()
    )
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}/{k}"))
    return out


def _full_batch_epochs(
    worker: ActorWorker, data: PPOData, *, epochs: int, den: float
) -> dict[str, float]:
    """The full-batch reference of K policy epochs (as verl computes them): one log-prob
    forward for the old log-probs, then per epoch one ``train_chunk`` over the whole
    batch with them and one update."""
    old = worker.compute_logprobs(data.batch)
    ref = worker.compute_ref_logprobs(data.batch) if worker.config.use_reference else None
    out: dict[str, float] = {}
    for _ in range(epochs):
        worker.train_chunk(
            data.batch,
            advantages=data.advantages,
            old_logprobs=old,
            ref_logprobs=ref,
            loss_denominator=den,
        )
        out = worker.finish_step()
    return out


def _streamed_epochs(
    worker: ActorWorker, data: PPOData, chunks: list[list[int]], *, epochs: int, den: float
) -> dict[str, float]:
    """Epoch 1 streamed over ``chunks`` (each its own old policy, kept on the rank), one
    update, then ``train_epochs`` for epochs 2..K over the kept chunks."""
    for rows in chunks:
        part = data.rows(rows)
        worker.train_chunk(
            part.batch, advantages=part.advantages, loss_denominator=den, keep=epochs > 1
        )
    out = worker.finish_step()
    if epochs > 1:
        out = worker.train_epochs(epochs=epochs - 1, loss_denominator=den)
    return out


@pytest.mark.parametrize("epochs", [1, 3])
@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([1, 5], id="1+5"),
        pytest.param([3, 3], id="3+3"),
        pytest.param([1, 1, 1, 1, 1, 1], id="6x1"),
    ],
)
@pytest.mark.parametrize("loss_agg", ["sample", "token"])
def test_streamed_epochs_equal_full_batch_epochs(
    backend: str, sizes: list[int], epochs: int, loss_agg: str
) -> None:
    """K policy epochs while streaming (epoch 1 over the chunks, epochs 2..K over the
    kept chunks) are the computation of K full-batch epochs with a separate log-prob
    forward: one micro-batch per row, so both runs push the same micro-batches through
    the same kernels in the same order, and parameters and Adam moments agree EXACTLY
    (a bound of 0: nothing differs but the call boundaries), KL loss and entropy on.
    No log-prob forward runs while streaming: K forward+backward passes per sample."""
    kw: dict[str, Any] = {
        "loss_agg": loss_agg,
        "kl_loss_coef": 0.05,
        "entropy_coef": 0.01,
        "micro_batch_size": 1,
    }
    data = make_data(6)
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg=loss_agg)
    full, streamed = (
        ActorWorker(actor_config(backend, **kw)),
        ActorWorker(actor_config(backend, **kw)),
    )
    m_full = _full_batch_epochs(full, data, epochs=epochs, den=den)
    m_stream = _streamed_epochs(streamed, data, split(sizes), epochs=epochs, den=den)
    assert m_full["actor/step"] == m_stream["actor/step"] == float(epochs)
    if epochs > 1:
        assert m_full["actor/clipfrac"] > 0  # later epochs move off ratio 1
    for key in ("loss/pg", "loss/kl", "loss/entropy", "actor/grad_norm", "actor/clipfrac"):
        assert m_stream[key] == m_full[key], key
    # parameters, Adam's moments and step counts, the scheduler: everything a checkpoint holds
    got, want = _flat(streamed._policy.checkpoint_state()), _flat(full._policy.checkpoint_state())
    assert len(want) > 3 * len(TINY_PARAMS_MIN)
    assert_states_close(got, want, rtol=0, atol=0)
    assert streamed.counters() == {
        "policy_forward": 0,  # no log-prob forward while streaming
        "policy_forward_backward": 6 * epochs,
        "reference_forward": 6,  # once, kept with the old log-probs
    }
    assert full.counters()["policy_forward"] == 6


def test_streamed_epochs_use_the_pre_update_log_probs(backend: str) -> None:
    """The kept old log-probs are those of the weights BEFORE the step's first update:
    re-computing them after epoch 1 (ratio 1 again in epoch 2) is another computation,
    which the equality above would catch; refusals: ``train_epochs`` before
    ``finish_step``, or with nothing kept."""
    kw: dict[str, Any] = {"micro_batch_size": 1, "loss_agg": "sample"}
    data = make_data(6)
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="sample")
    kept, recomputed = (
        ActorWorker(actor_config(backend, **kw)),
        ActorWorker(actor_config(backend, **kw)),
    )
    _streamed_epochs(kept, data, split([3, 3]), epochs=2, den=den)
    for _ in range(2):  # the wrong way: each epoch its own old log-probs
        recomputed.train_chunk(data.batch, advantages=data.advantages, loss_denominator=den)
        recomputed.finish_step()
    a, b = kept.export_weights(), recomputed.export_weights()
    assert a is not None and b is not None
    assert max_diff(a, b) > 0
    with pytest.raises(ValueError, match="no chunk was kept"):
        kept.train_epochs(epochs=1, loss_denominator=den)
    kept.train_chunk(data.batch, advantages=data.advantages, loss_denominator=den, keep=True)
    with pytest.raises(ValueError, match="finish_step"):
        kept.train_epochs(epochs=1, loss_denominator=den)


def test_token_denominator_known_only_at_finish(backend: str) -> None:
    """Streaming with loss_agg=token: chunks use a provisional denominator, finish_step
    gets the true one and rescales; same gradients and parameters as the full batch."""
    data = prepared(backend)
    full = ActorWorker(actor_config(backend))
    logprobs = full.compute_logprobs(data.batch)
    s_full = run_actor(full, data, [list(range(6))], loss_agg="token")
    m_full = s_full.metrics
    late = ActorWorker(actor_config(backend))
    for rows in split([4, 2]):
        part = data.rows(rows)
        late.train_chunk(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=1.0,  # provisional
        )
    # The gradients before the rescale: the full run's times the true denominator.
    true_den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    provisional = {k: g / true_den for k, g in hf_named(late, late.grads()).items()}
    m_late = late.finish_step(loss_denominator=true_den)
    # Same micro-batches as the full run ([0, 1], [2, 3], [4, 5]); only the division by
    # the denominator moved (inside the loss vs one rescale): 2 roundings of each element
    # on top of the same accumulation.
    terms = step_terms(data) + 2
    bounds = grad_bounds(s_full.magnitude, terms=terms)
    assert_within(provisional, s_full.grads, bounds)
    # loss/pg: the same per-token losses; each micro-batch sum is divided once more
    # (float32) in the full run, the late one is scaled once in float64 at the end.
    magnitude = pg_magnitude(logprobs, data, loss_agg="token")
    assert abs(m_late["loss/pg"] - m_full["loss/pg"]) <= rounding_bound(
        terms=4, magnitude=magnitude
    )
    assert abs(m_late["actor/grad_norm"] - m_full["actor/grad_norm"]) <= norm_bound(
        s_full.grads, bounds
    )
    moved = adam_step_bound(
        grads=s_full.grads,
        grad_bound=bounds,
        params=full.export_weights(),
        lr=m_full["actor/lr"],
        adam_eps=full.config.adam_eps,
        grad_norm=m_full["actor/grad_norm"],
        max_grad_norm=full.config.max_grad_norm,
    )
    assert_within(late.export_weights(), full.export_weights(), moved)
    assert max(float(g.abs().max()) for g in s_full.grads.values()) > 1e-3


def test_sample_denominator_counts_all_or_valid_samples(backend: str) -> None:
    data = prepared(backend)
    data.batch["loss_mask"][1] = 0.0  # one sample without a valid token
    rows = float(data.batch["loss_mask"].shape[0])
    valid = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="sample")
    assert valid == rows - 1
    for den in (rows, valid):
        worker = ActorWorker(actor_config(backend, loss_agg="sample"))
        for chunk in split([3, 3]):
            part = data.rows(chunk)
            worker.train_chunk(
                part.batch,
                old_logprobs=part.old_logprobs,
                advantages=part.advantages,
                loss_denominator=den,
            )
        worker.finish_step()
    bad = ActorWorker(actor_config(backend, loss_agg="sample"))
    bad.train_chunk(
        data.batch,
        old_logprobs=data.old_logprobs,
        advantages=data.advantages,
        loss_denominator=rows + 1,
    )
    with pytest.raises(ValueError, match="sample count"):
        bad.finish_step()


def test_per_chunk_normalisation_is_the_only_difference(backend: str) -> None:
    data = prepared(backend)
    chunks = split([2, 4])
    mask = data.batch["loss_mask"]
    per_chunk = torch.cat(
        [masked_whiten(values=data.advantages[rows], mask=mask[rows]) for rows in chunks]
    )
    whole = masked_whiten(values=data.advantages, mask=mask)

    def with_adv(adv: torch.Tensor) -> PPOData:
        return PPOData(data.batch, data.old_logprobs, adv, data.returns, data.old_values)

    streamed = ActorWorker(actor_config(backend))
    s_stream = run_actor(streamed, with_adv(per_chunk), chunks, loss_agg="token")
    same_adv = ActorWorker(actor_config(backend))
    s_same = run_actor(same_adv, with_adv(per_chunk), [list(range(6))], loss_agg="token")
    full_norm = ActorWorker(actor_config(backend))
    s_norm = run_actor(full_norm, with_adv(whole), [list(range(6))], loss_agg="token")
    # Streaming with per-chunk normalisation == full batch fed the per-chunk advantages ...
    assert_same_step(
        s_same,
        s_stream,
        weights_a=same_adv.export_weights(),
        weights_b=streamed.export_weights(),
        terms=step_terms(data),
        config=same_adv.config,
    )
    # ... and differs from full-batch normalisation by the normalisation alone.
    assert not torch.allclose(per_chunk, whole, atol=1e-3)
    assert max_diff(s_stream.grads, s_norm.grads) > 1e-3


def test_a_micro_batch_is_computed_alike_whatever_batch_it_was_cut_from(backend: str) -> None:
    """Each micro-batch is cut to its own width (the columns its rows attend to), so its
    outputs and its gradient are the same bits whether it came in a wide batch (the
    whole step: padded to the step's longest row) or alone (a streamed chunk: padded to
    its own longest row). Without the cut the weight gradients differ in the last bits
    (their GEMMs reduce over the padded positions too, blocked by the width), and a
    streamed step could not equal a full-batch step bit for bit."""
    data = prepared(backend, b=6, seed=3)
    lengths = data.batch["attention_mask"].sum(dim=1)
    width = data.batch["input_ids"].shape[1]
    micro = [list(range(0, 3)), list(range(3, 6))]
    own = [int(lengths[rows].max()) for rows in micro]
    assert min(own) < width  # a micro-batch narrower than the batch around it

    def alone(rows: list[int], w: int) -> PPOData:
        part = data.rows(rows)
        return PPOData(
            batch={k: v[:, :w] for k, v in part.batch.items()},
            old_logprobs=part.old_logprobs[:, :w],
            advantages=part.advantages[:, :w],
            returns=part.returns[:, :w],
            old_values=part.old_values[:, :w],
        )

    wide, narrow = (ActorWorker(actor_config(backend, micro_batch_size=3)) for _ in range(2))
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    g_wide, _ = train_chunks(wide, data, [list(range(6))], den=den)
    g_narrow: dict[str, torch.Tensor] = {}
    for rows, w in zip(micro, own, strict=True):
        part = alone(rows, w)
        narrow.train_chunk(
            part.batch, old_logprobs=part.old_logprobs, advantages=part.advantages,
            loss_denominator=den,
        )  # fmt: skip
        g_narrow = hf_named(narrow, narrow.grads())
    assert g_wide.keys() == g_narrow.keys()
    assert all(torch.equal(g_wide[k], g_narrow[k]) for k in g_wide), max_diff(g_wide, g_narrow)
    # the forwards too, and every position without a token is 0
    critic = CriticWorker(critic_config(backend, micro_batch_size=3))
    lp, values = wide.compute_logprobs(data.batch), critic.compute_values(data.batch)
    for rows, w in zip(micro, own, strict=True):
        part = alone(rows, w)
        assert torch.equal(wide.compute_logprobs(part.batch), lp[rows, :w])
        assert torch.equal(critic.compute_values(part.batch), values[rows, :w])
    pad = ~data.batch["attention_mask"].bool()
    assert bool((lp[pad] == 0).all()) and bool((values[pad] == 0).all())


def test_masked_chunk_adds_no_gradient(backend: str) -> None:
    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    den = loss_denominator(loss_mask=data.batch["loss_mask"][:3], loss_agg="token")
    first = data.rows([0, 1, 2])
    actor.train_chunk(
        first.batch,
        old_logprobs=first.old_logprobs,
        advantages=first.advantages,
        loss_denominator=den,
    )
    before = actor.grads()
    masked = data.rows([3, 4, 5])
    masked.batch["loss_mask"] = torch.zeros_like(masked.batch["loss_mask"])
    out = actor.train_chunk(
        masked.batch,
        old_logprobs=masked.old_logprobs,
        advantages=masked.advantages,
        loss_denominator=den,
    )
    assert out["actor/valid_tokens"] == 0
    assert_states_close(actor.grads(), before, rtol=0, atol=0)
    actor.finish_step()


def test_all_masked_step_raises_before_any_update(backend: str) -> None:
    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    weights = actor.export_weights()
    masked = data.rows([0, 1])
    masked.batch["loss_mask"] = torch.zeros_like(masked.batch["loss_mask"])
    actor.train_chunk(
        masked.batch,
        old_logprobs=masked.old_logprobs,
        advantages=masked.advantages,
        loss_denominator=1.0,
    )
    with pytest.raises(EmptyStepError, match="masked"):
        actor.finish_step()
    assert_states_close(actor.export_weights(), weights, rtol=0, atol=0)
    assert actor.global_step == 0
    # the worker is usable afterwards
    run_actor(actor, data, [list(range(6))], loss_agg="token")
    assert actor.global_step == 1
    assert max_diff(actor.export_weights(), weights) > 0


def test_wrong_denominator_is_rejected_before_update(backend: str) -> None:
    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    weights = actor.export_weights()
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    part = data.rows([0, 1])
    actor.train_chunk(
        part.batch,
        old_logprobs=part.old_logprobs,
        advantages=part.advantages,
        loss_denominator=den,
    )
    with pytest.raises(ValueError, match="differs"):
        actor.train_chunk(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=den + 1,
        )
    with pytest.raises(ValueError, match="does not match"):
        actor.finish_step()  # only 2 of 6 samples were sent
    assert_states_close(actor.export_weights(), weights, rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss_denominator=0"):
        actor.train_chunk(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=0,
        )


def test_non_finite_update_is_refused_before_the_optimizer_step(backend: str) -> None:
    """Advantages / returns of 1e30 (a runaway reward): the actor's gradient norm and the
    critic's value loss overflow float32. Each worker refuses before its optimizer step,
    naming the quantity, and nothing changes (weights, step counters)."""
    data = prepared(backend)
    huge = torch.full_like(data.advantages, 1e30) * data.batch["loss_mask"]
    actor = ActorWorker(actor_config(backend))
    weights = actor.export_weights()
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    actor.train_chunk(
        data.batch, old_logprobs=data.old_logprobs, advantages=huge, loss_denominator=den
    )
    with pytest.raises(FloatingPointError, match=r"actor/grad_norm = inf is not finite"):
        actor.finish_step()
    assert actor.global_step == 0
    assert_states_close(actor.export_weights(), weights, rtol=0, atol=0)

    critic = CriticWorker(critic_config(backend))
    weights = critic.export_weights()
    with pytest.raises(FloatingPointError, match=r"loss/value = inf is not finite"):
        critic.train(
            data.batch, returns=huge, old_values=data.old_values, epochs=1, mini_batch_size=6
        )
    assert critic.global_step == 0
    assert_states_close(critic.export_weights(), weights, rtol=0, atol=0)


# --------------------------------------------------------------------------- lifecycle


def test_gradients_survive_keep_gradients_sleep(backend: str) -> None:
    data = prepared(backend)
    chunks = split([3, 3])
    plain = ActorWorker(actor_config(backend))
    s_plain = run_actor(plain, data, chunks, loss_agg="token")

    actor = ActorWorker(actor_config(backend))
    critic = CriticWorker(critic_config(backend))
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    critic.sleep()
    first, second = data.rows(chunks[0]), data.rows(chunks[1])
    actor.train_chunk(
        first.batch,
        old_logprobs=first.old_logprobs,
        advantages=first.advantages,
        loss_denominator=den,
    )
    held = actor.grads()
    actor.sleep(parts=KEEP_GRADIENTS)
    assert actor.is_asleep and actor.asleep_parts == KEEP_GRADIENTS
    assert_states_close(actor.grads(), held, rtol=0, atol=0)  # still resident
    critic.wake_up()
    values = critic.compute_values(second.batch)  # the critic works in between
    assert values.shape == second.batch["input_ids"].shape
    critic.sleep()
    actor.wake_up()
    assert not actor.is_asleep
    assert_states_close(actor.grads(), held, rtol=0, atol=0)
    actor.train_chunk(
        second.batch,
        old_logprobs=second.old_logprobs,
        advantages=second.advantages,
        loss_denominator=den,
    )
    # The same chunks in the same order as ``plain``: sleeping and waking moved memory
    # only, so gradients and the updated weights are bit-identical.
    assert_states_close(hf_named(actor, actor.grads()), s_plain.grads, rtol=0, atol=0)
    actor.finish_step()
    assert_states_close(actor.export_weights(), plain.export_weights(), rtol=0, atol=0)


def test_sleep_wake_idempotent_and_guarded(backend: str) -> None:
    data = make_data(4)
    actor = ActorWorker(actor_config(backend, kl_loss_coef=0.1))
    lp = actor.compute_logprobs(data.batch)
    ref = actor.compute_ref_logprobs(data.batch)
    torch.testing.assert_close(lp, ref, rtol=0, atol=0)  # reference == initial policy
    actor.sleep(parts=KEEP_GRADIENTS)
    actor.sleep(parts=KEEP_GRADIENTS)  # logged no-op
    actor.sleep()  # now the gradients too
    assert actor.asleep_parts == frozenset(Part)
    with pytest.raises(RuntimeError, match="asleep"):
        actor.compute_logprobs(data.batch)
    with pytest.raises(RuntimeError, match="asleep"):
        actor.finish_step()
    actor.wake_up()
    actor.wake_up()  # logged no-op
    torch.testing.assert_close(actor.compute_logprobs(data.batch), lp, rtol=0, atol=0)
    torch.testing.assert_close(actor.compute_ref_logprobs(data.batch), ref, rtol=0, atol=0)
    critic = CriticWorker(critic_config(backend))
    v = critic.compute_values(data.batch)
    critic.sleep()
    critic.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        critic.compute_values(data.batch)
    critic.wake_up()
    torch.testing.assert_close(critic.compute_values(data.batch), v, rtol=0, atol=0)


# --------------------------------------------------------------------------- critic


def test_critic_old_values_and_frozen_returns(backend: str) -> None:
    data = make_data(6, seed=3)
    critic = CriticWorker(critic_config(backend, value_clip=0.05))
    old = critic.compute_values(data.batch)
    assert bool((old[:, 0] == 0).all())
    again = CriticWorker(critic_config(backend, value_clip=0.05))
    torch.testing.assert_close(again.compute_values(data.batch), old, rtol=0, atol=0)
    # train(epochs=2) == two train(epochs=1) calls fed the SAME returns and old values:
    # the epochs never recompute targets from the updated critic.
    m = critic.train(data.batch, returns=data.returns, old_values=old, epochs=2, mini_batch_size=4)
    assert m["critic/optimizer_steps"] == 4
    assert m["critic/clipfrac"] > 0
    for _ in range(2):
        again.train(data.batch, returns=data.returns, old_values=old, epochs=1, mini_batch_size=4)
    # the same mini-batches in the same order: bit-identical
    assert_states_close(again.export_weights(), critic.export_weights(), rtol=0, atol=0)
    new = critic.compute_values(data.batch)
    assert float((new - old).abs().max()) > 1e-4  # the update changed the values
    # refreshing old values from the updated critic would train differently (clipping)
    third = CriticWorker(critic_config(backend, value_clip=0.05))
    third.train(data.batch, returns=data.returns, old_values=old, epochs=1, mini_batch_size=4)
    third.train(
        data.batch,
        returns=data.returns,
        old_values=third.compute_values(data.batch),
        epochs=1,
        mini_batch_size=4,
    )
    assert max_diff(third.export_weights(), critic.export_weights()) > 1e-6


def test_critic_rejects_all_masked(backend: str) -> None:
    data = make_data(2)
    critic = CriticWorker(critic_config(backend))
    with pytest.raises(EmptyStepError):
        critic.train(
            {**data.batch, "loss_mask": torch.zeros_like(data.batch["loss_mask"])},
            returns=data.returns,
            old_values=data.old_values,
            epochs=1,
            mini_batch_size=2,
        )


# --------------------------------------------------------------------------- round trips


def test_hf_round_trip(backend: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    run_actor(actor, data, [list(range(6))], loss_agg="token")
    weights = actor.export_weights()
    assert all(v.device.type == "cpu" for v in weights.values())
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
    lp = actor.compute_logprobs(data.batch)
    hf_dir = save_hf_checkpoint(weights=weights, spec=actor.config.model, path=tmp_path / "hf")
    # transformers itself, on the exported weights, gives the same log-probs
    model = AutoModelForCausalLM.from_pretrained(hf_dir, use_safetensors=True)
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        logits = model(
            input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"]
        ).logits
    ids = data.batch["input_ids"]
    hf_lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    # Another batch split (and for megatron another implementation): rounding only, along
    # the forward chain; a log-prob z_y - logsumexp(z) carries twice the logits' error.
    b, t = ids.shape
    terms = model_terms(TINY, tokens=b * t, seq_len=t, backward=False)
    bound = rounding_bound(terms=terms, magnitude=2 * head_magnitude(model, data.batch))
    # the worker's log-probs are 0 where no token is (attention mask 0)
    attended = data.batch["attention_mask"][:, 1:].bool()
    hf_lp = torch.where(attended, hf_lp, torch.zeros_like(hf_lp))
    torch.testing.assert_close(lp[:, 1:], hf_lp, rtol=0, atol=bound)
    # and a worker loaded from the directory (the same weights, the same computation)
    # reproduces the worker's log-probs bit for bit
    loaded = ActorWorker(actor_config(backend, model=ModelSpec(path=str(hf_dir))))
    torch.testing.assert_close(loaded.compute_logprobs(data.batch), lp, rtol=0, atol=0)
    assert_states_close(loaded.export_weights(), weights, rtol=0, atol=0)

    critic = CriticWorker(critic_config(backend))
    critic.train(
        data.batch, returns=data.returns, old_values=data.old_values, epochs=1, mini_batch_size=6
    )
    cw = critic.export_weights()
    assert "score.weight" in cw
    c_dir = save_hf_checkpoint(
        weights=cw, spec=critic.config.model, path=tmp_path / "hfc", role="critic"
    )
    c_loaded = CriticWorker(critic_config(backend, model=ModelSpec(path=str(c_dir))))
    torch.testing.assert_close(  # the same weights, the same computation: bit for bit
        c_loaded.compute_values(data.batch), critic.compute_values(data.batch), rtol=0, atol=0
    )


def test_torch_adamw_is_the_fused_kernel_and_steps_as_torchs_loop() -> None:
    """The torch backend's AdamW is torch's fused kernel (one call for all tensors per
    step). Checked against torch's per-tensor AdamW (``foreach=False``), an independent
    implementation: from the same weights and the same summed gradients (clipped as the
    backend clips them), one step lands within the rounding of Adam's few operations and
    of the new weight (``adam_step_bound`` with no gradient difference)."""
    kw: dict[str, Any] = {"weight_decay": 0.01}
    data = prepared("torch", **kw)
    actor = ActorWorker(actor_config("torch", **kw))
    assert actor._policy.optimizer.param_groups[0]["fused"] is True  # type: ignore[attr-defined]
    start = {k: v.clone() for k, v in actor.export_weights().items()}
    step = run_actor(actor, data, [list(range(6))], loss_agg="token")
    config, lr = actor.config, step.metrics["actor/lr"]
    params = {k: torch.nn.Parameter(v) for k, v in start.items()}
    for name, p in params.items():
        p.grad = step.grads[name].clone()
    torch.nn.utils.clip_grad_norm_(list(params.values()), config.max_grad_norm)
    reference = torch.optim.AdamW(
        list(params.values()), lr=lr, betas=config.betas, eps=config.adam_eps,
        weight_decay=config.weight_decay, foreach=False,
    )  # fmt: skip
    reference.step()
    want = {k: p.detach() for k, p in params.items()}
    got = actor.export_weights()
    assert any(not torch.equal(got[k], start[k]) for k in got)  # the step moved the weights
    zero = {k: torch.zeros_like(g) for k, g in step.grads.items()}
    bound = adam_step_bound(
        grads=step.grads, grad_bound=zero, params=want, lr=lr, adam_eps=config.adam_eps,
        grad_norm=step.metrics["actor/grad_norm"], max_grad_norm=config.max_grad_norm,
    )  # fmt: skip
    assert_within(got, want, bound)


def test_checkpoint_round_trip(backend: str, tmp_path: Path) -> None:
    kw: dict[str, Any] = {"warmup_steps": 2, "kl_loss_coef": 0.05}
    d1, d2 = prepared(backend, seed=1, **kw), prepared(backend, seed=2, **kw)
    actor = ActorWorker(actor_config(backend, **kw))
    critic = CriticWorker(critic_config(backend, warmup_steps=2))
    run_actor(actor, d1, [list(range(6))], loss_agg="token")
    critic.train(
        d1.batch, returns=d1.returns, old_values=d1.old_values, epochs=1, mini_batch_size=3
    )
    actor.save_checkpoint(tmp_path / "actor")
    critic.save_checkpoint(tmp_path / "critic")
    files = sorted(p.name for p in (tmp_path / "actor").rglob("*") if p.is_file())
    assert files == ["state.json", "state.safetensors"]  # no pickle anywhere
    m_a = run_actor(actor, d2, [list(range(6))], loss_agg="token").metrics
    critic.train(
        d2.batch, returns=d2.returns, old_values=d2.old_values, epochs=1, mini_batch_size=3
    )

    actor2 = ActorWorker(actor_config(backend, **kw))
    critic2 = CriticWorker(critic_config(backend, warmup_steps=2))
    actor2.load_checkpoint(tmp_path / "actor")
    critic2.load_checkpoint(tmp_path / "critic")
    assert actor2.global_step == 1 and critic2.global_step == 2
    # Loaded state owns its memory: the first sleep after a resume can release it.
    for worker in (actor2, critic2):
        worker.sleep()
        worker.wake_up()
    m_b = run_actor(actor2, d2, [list(range(6))], loss_agg="token").metrics
    critic2.train(
        d2.batch, returns=d2.returns, old_values=d2.old_values, epochs=1, mini_batch_size=3
    )
    assert m_a["actor/lr"] == m_b["actor/lr"] < actor.config.lr  # scheduler state restored
    assert_states_close(actor2.export_weights(), actor.export_weights(), rtol=0, atol=0)
    assert_states_close(critic2.export_weights(), critic.export_weights(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not an actor"):
        actor2.load_checkpoint(tmp_path / "critic")


# --------------------------------------------------------------------------- two DP ranks

SHARDS = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}  # global mini-batch i = union of rank mini-batches i
CHUNKS = {0: [[0], [1, 2, 3]], 1: [[0, 1, 2], [3]]}  # positions within each rank's shard


def _dp_rank_main(rank: int, backend: str, init: str, data_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small CPU machine
    data = PPOData.from_tensors(load_file(data_file)).rows(SHARDS[rank])
    den = float(load_file(data_file)["batch.loss_mask"].sum())
    actor = ActorWorker(actor_config(backend), rank=rank, world_size=2, dist_init_method=init)
    grads, magnitude = train_chunks(actor, data, CHUNKS[rank], den=den)
    actor.finish_step()
    critic = CriticWorker(critic_config(backend), rank=rank, world_size=2, dist_init_method=init)
    critic.train(
        data.batch, returns=data.returns, old_values=data.old_values, epochs=2, mini_batch_size=2
    )
    exported = actor.export_weights()  # a collective; the weights come back on rank 0 only
    assert (exported is None) == (rank != 0)
    weights = exported if exported is not None else actor._policy.export_hf()  # instrumentation
    save_file(weights, f"{out_dir}/actor{rank}.safetensors")
    save_file(critic.export_weights(), f"{out_dir}/critic{rank}.safetensors")
    save_file(grads, f"{out_dir}/grads{rank}.safetensors")  # local, before the all-reduce
    save_file(magnitude, f"{out_dir}/magnitude{rank}.safetensors")


def test_two_data_parallel_ranks_match_single_process(backend: str, tmp_path: Path) -> None:
    data = prepared(backend, b=8)
    data_file = str(tmp_path / "data.safetensors")
    save_file({k: v.contiguous() for k, v in data.tensors().items()}, data_file)
    mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _dp_rank_main,
        args=(backend, f"file://{tmp_path / 'pg'}", data_file, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    actor = ActorWorker(actor_config(backend))
    single = run_actor(actor, data, [list(range(8))], loss_agg="token")
    critic = CriticWorker(critic_config(backend))
    critic.train(
        data.batch, returns=data.returns, old_values=data.old_values, epochs=2, mini_batch_size=4
    )
    # Actor: the ranks' chunks differ from the single process's micro-batches (rounding
    # only); the all-reduce adds one more term to each accumulation.
    local = [load_file(str(tmp_path / f"grads{rank}.safetensors")) for rank in (0, 1)]
    mags = [load_file(str(tmp_path / f"magnitude{rank}.safetensors")) for rank in (0, 1)]
    summed = {k: local[0][k] + local[1][k] for k in local[0]}
    two_ranks = ActorStep(summed, {k: mags[0][k] + mags[1][k] for k in summed}, {})
    weights = actor.export_weights()
    for rank in (0, 1):
        assert_same_step(
            single,
            two_ranks,
            weights_a=weights,
            weights_b=load_file(str(tmp_path / f"actor{rank}.safetensors")),
            terms=step_terms(data) + 1,
            config=actor.config,
        )
    # Critic: rank r's mini-batch i is micro-batch r of the single process's mini-batch i,
    # and the all-reduce of two ranks adds the same two gradients the single process
    # accumulates (a + b == b + a): the same operations, bit-identical weights.
    for rank in (0, 1):
        assert_states_close(
            load_file(str(tmp_path / f"critic{rank}.safetensors")),
            critic.export_weights(),
            rtol=0,
            atol=0,
        )
