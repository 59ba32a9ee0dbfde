"""CUDA checks of the torch backend (run on a lent GPU machine; skipped without CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ppo_trainer import KEEP_GRADIENTS, ActorWorker, CriticWorker, loss_denominator
from trainer_testlib import actor_config, critic_config, make_data, with_model_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

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
    full.backward(
        data.batch,
        old_logprobs=data.old_logprobs,
        advantages=data.advantages,
        loss_denominator=den,
    )
    g_full = full.grads()
    full.finish_step()

    critic.sleep()
    for rows in ([0, 1], [2, 3, 4, 5]):
        part = data.rows(rows)
        actor.wake_up()
        actor.backward(
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
        critic.wake_up()
        critic.compute_values(part.batch)
        critic.sleep()
    actor.wake_up()
    for k, g in actor.grads().items():
        torch.testing.assert_close(g, g_full[k], rtol=1e-3, atol=1e-5)
    actor.finish_step()
    expected = full.export_weights()
    for k, w in actor.export_weights().items():
        assert w.device.type == "cpu"
        torch.testing.assert_close(w, expected[k], rtol=1e-4, atol=1e-5)
