"""The CPU shim that lets megatron-core run without CUDA (``ppo_trainer.megatron._cpu_shim``).

The shim only exists without CUDA, so these tests skip on a GPU machine; there,
``test_megatron_gpu.py`` checks that it stays inactive.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ppo_trainer.megatron", reason="needs the megatron extra")

from ppo_trainer.megatron import _cpu_shim

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU shim is inactive when CUDA is present"
)


def test_cuda_devices_map_to_cpu_inside_only() -> None:
    with _cpu_shim.cuda_as_cpu():
        made = [
            torch.zeros(2, device="cuda"),
            torch.ones(2, device=torch.device("cuda", 0)),
            torch.empty(2, device=torch.cuda.current_device()),
            torch.arange(3).to("cuda"),
            torch.arange(3).to(device="cuda:0"),
            torch.arange(3).cuda(),
        ]
        assert all(t.device.type == "cpu" for t in made)
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"  # clip_grads' type check
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda.synchronize()
        assert not torch.cuda.is_available()
    # outside the context nothing is rewritten
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_rng_tracker_forks_cpu_state_and_restores_it() -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with _cpu_shim.cuda_as_cpu():
        tracker = get_cuda_rng_tracker()
        if "ppo-test" not in tracker.get_states():
            tracker.add("ppo-test", 4242)
        torch.manual_seed(0)
        with tracker.fork("ppo-test"):
            first = torch.rand(3)
        after = torch.rand(3)
        with tracker.fork("ppo-test"):
            second = torch.rand(3)  # the tracked stream continues
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))  # the outer stream never moved
    assert not torch.equal(first, second)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(4242)))
