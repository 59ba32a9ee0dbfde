"""CUDA checks of the torch backend (run on a lent GPU machine; skipped without CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ppo_lifecycle import KEEP_GRADIENTS
from ppo_trainer import ActorWorker, CriticWorker, loss_denominator
from trainer_testlib import (
    TINY,
    actor_config,
    adam_step_bound,
    assert_within,
    critic_config,
    grad_bounds,
    make_data,
    model_terms,
    with_model_inputs,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    # The derived float32 bounds assume float32 products (TF32 keeps 10 mantissa bits).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


_TMS = importlib.util.find_spec("torch_memory_saver") is not None


@pytest.mark.parametrize(
    "offload_backend",
    [
        pytest.param("host_copy", id="host_copy"),
        pytest.param(
            "torch_memory_saver",
            id="torch_memory_saver",
            marks=pytest.mark.skipif(not _TMS, reason="torch_memory_saver not installed"),
        ),
    ],
)
def test_cuda_streaming_with_keep_gradients_sleep(offload_backend: str) -> None:
    kw = {"device": "cuda", "offload_backend": offload_backend}
    data = make_data(6)
    actor = ActorWorker(actor_config("torch", **kw))
    critic = CriticWorker(critic_config("torch", **kw))
    data = with_model_inputs(
        data, actor.compute_logprobs(data.batch), critic.compute_values(data.batch)
    )
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")

    full = ActorWorker(actor_config("torch", **kw))
    full.train_chunk(
        data.batch,
        old_logprobs=data.old_logprobs,
        advantages=data.advantages,
        loss_denominator=den,
    )
    g_full = {k: g.cpu() for k, g in full.grads().items()}
    m_full = full.finish_step()

    critic.sleep()
    magnitude = {k: g.abs() for k, g in g_full.items()}
    previous = {k: torch.zeros_like(g) for k, g in g_full.items()}
    for rows in ([0, 1], [2, 3, 4, 5]):
        part = data.rows(rows)
        actor.wake_up()
        actor.train_chunk(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=den,
        )
        held = actor.grads()
        before = torch.cuda.memory_allocated()
        actor.sleep(parts=KEEP_GRADIENTS)
        torch.cuda.synchronize()
        if offload_backend == "host_copy":
            assert torch.cuda.memory_allocated() < before  # parameters and Adam state left
        for k, g in actor.grads().items():
            assert g.is_cuda
            torch.testing.assert_close(g, held[k], rtol=0, atol=0)
        now = {k: g.cpu() for k, g in held.items()}
        magnitude = {k: torch.maximum(magnitude[k], (now[k] - previous[k]).abs()) for k in now}
        previous = now
        critic.wake_up()
        critic.compute_values(part.batch)
        critic.sleep()
    actor.wake_up()
    # Chunks vs one batch: float32 rounding only (trainer_testlib's derived bounds).
    b, t = data.batch["input_ids"].shape
    bounds = grad_bounds(magnitude, terms=model_terms(TINY, tokens=b * t, seq_len=t))
    assert_within({k: g.cpu() for k, g in actor.grads().items()}, g_full, bounds)
    actor.finish_step()
    expected = full.export_weights()
    moved = adam_step_bound(
        grads=g_full,
        grad_bound=bounds,
        params=expected,
        lr=m_full["actor/lr"],
        adam_eps=full.config.adam_eps,
        grad_norm=m_full["actor/grad_norm"],
        max_grad_norm=full.config.max_grad_norm,
    )
    weights = actor.export_weights()
    assert all(w.device.type == "cpu" for w in weights.values())
    assert_within(weights, expected, moved)
