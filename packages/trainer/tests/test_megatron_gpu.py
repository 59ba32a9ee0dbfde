"""The megatron backend on CUDA (NCCL; Transformer Engine layer spec when TE imports).

Marked ``gpu``: skipped without CUDA. Run on a lent GPU machine with the ``megatron``
extra (and ``te`` for the Transformer Engine spec):
``pytest packages/trainer/tests/test_megatron_gpu.py -m gpu``.
Tolerances: TF32 is switched off; logits vs transformers within trainer_testlib's
``rounding_bound`` over the forward chain and the head's magnitude (cuBLAS / TE kernels
reorder float32 sums).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ppo_trainer.megatron", reason="needs the megatron extra")

from ppo_trainer import ActorConfig, ModelSpec, get_backend
from ppo_trainer._torch_backend import build_causal_lm
from ppo_trainer.megatron import _cpu_shim, transformer_engine_available
from trainer_testlib import head_magnitude, model_terms, rounding_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SPEC = ModelSpec(seed=5)


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_cpu_shim_is_inactive_with_cuda() -> None:
    real_current_device = torch.cuda.current_device
    with _cpu_shim.cuda_as_cpu():
        assert torch.zeros(1, device="cuda").device.type == "cuda"
        assert torch.zeros(1).type() == "torch.FloatTensor"
        assert torch.cuda.current_device is real_current_device
    assert not _cpu_shim.is_needed()


@pytest.fixture(scope="module")
def backend() -> object:
    return get_backend("megatron")(
        config=ActorConfig(model=SPEC, backend="megatron"),
        rank=0,
        world_size=1,
        dist_init_method=None,
    )


def test_nccl_and_layer_spec(backend: object) -> None:
    import torch.distributed as dist

    assert dist.get_backend() == "nccl"
    assert backend.use_te == transformer_engine_available()  # type: ignore[attr-defined]


def test_policy_matches_transformers_on_gpu(backend: object) -> None:
    policy = backend.build_policy()  # type: ignore[attr-defined]
    if transformer_engine_available():
        names = {n for n, _ in policy.gpt.named_parameters()}
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    hf = build_causal_lm(SPEC, device="cuda")
    exported = policy.export_hf()
    for name, value in hf.state_dict().items():
        assert torch.equal(exported[name], value.cpu()), name
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, SPEC.vocab_size, (2, 16), generator=g).cuda()
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=attn).logits.float()
    (logits,) = policy.forward([{"input_ids": ids, "attention_mask": attn}], fn=lambda o, mb: o)
    terms = model_terms(SPEC, tokens=ids.numel(), seq_len=ids.shape[1], backward=False)
    magnitude = head_magnitude(hf, {"input_ids": ids, "attention_mask": attn})
    torch.testing.assert_close(
        logits, ref, atol=rounding_bound(terms=terms, magnitude=magnitude), rtol=0
    )
    loss_fn = lambda out, mb: (out.float().logsumexp(-1).mean(), {})  # noqa: E731
    policy.forward_backward([{"input_ids": ids, "attention_mask": attn}], loss_fn=loss_fn)
    policy.all_reduce_grads()
    stats = policy.step()
    assert stats["grad_norm"] > 0
    policy.zero_grad()
    assert not torch.equal(policy.export_hf()["lm_head.weight"], exported["lm_head.weight"])


def test_keep_gradients_sleep_frees_parameters(backend: object) -> None:
    from ppo_lifecycle import KEEP_GRADIENTS

    policy = backend.build_policy()  # type: ignore[attr-defined]
    ids = torch.randint(1, SPEC.vocab_size, (2, 8)).cuda()
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    policy.forward_backward([mb], loss_fn=lambda out, mb: (out.float().mean(), {}))
    grads = policy.grads()
    before = policy.export_hf()
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    policy.sleep(parts=KEEP_GRADIENTS)
    assert torch.cuda.memory_allocated() < used
    policy.wake_up()
    after = policy.export_hf()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    for name, g in policy.grads().items():
        assert torch.equal(g, grads[name]), name
