"""CUDA paths: pinned host copies and torch_memory_saver regions (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from lifecycle_models import assert_bit_exact, batch, loss_fn, make, snapshot, train_step
from ppo_lifecycle import ALL_PARTS, KEEP_GRADIENTS, OffloadManager, Part

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _trained_cuda() -> tuple[torch.nn.Module, torch.optim.Adam]:
    model, opt = make(device="cuda")
    train_step(model, opt, seed=1)
    loss_fn(model, batch(2, "cuda")).backward()
    return model, opt


def test_host_copy_on_cuda_frees_device_memory_and_round_trips() -> None:
    model, opt = _trained_cuda()
    manager = OffloadManager(model, opt, name="actor")
    before = snapshot(model, opt)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    total = manager.device_bytes()
    manager.sleep(parts=KEEP_GRADIENTS)
    kept = manager.part_bytes()[Part.GRADIENTS]
    assert torch.cuda.memory_allocated() <= allocated - (total - kept)
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_torch_memory_saver_pauses_per_part() -> None:
    pytest.importorskip("torch_memory_saver")
    from ppo_lifecycle import TorchMemorySaverBackend

    device = torch.device("cuda", torch.cuda.current_device())
    backend = TorchMemorySaverBackend(device, name="tms")
    with backend.region(Part.PARAMETERS):
        big = torch.nn.Linear(4096, 4096, device=device)  # 64 MiB of parameters
    backend.adopt_tensors(Part.PARAMETERS, big.parameters())
    opt = torch.optim.Adam(big.parameters(), lr=1e-3)
    manager = OffloadManager(big, opt, backend=backend, name="tms")
    x = torch.randn(8, 4096, device="cuda")
    # A region captures only this thread's allocations; backward() allocates on
    # autograd's own thread, so create the gradients here and let it accumulate.
    with manager.allocation_region(Part.GRADIENTS):
        for p in big.parameters():
            p.grad = torch.zeros_like(p)
    big(x).sum().backward()
    with manager.allocation_region(Part.OPTIMIZER):
        opt.step()
    big(x).sum().backward()
    before = snapshot(big, opt)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    manager.sleep(parts=KEEP_GRADIENTS)
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_before >= 3 * 64 * 2**20 * 0.9  # params + Adam moments
    manager.sleep(parts=KEEP_GRADIENTS)  # idempotent: no second pause
    manager.wake_up()
    manager.wake_up()  # idempotent: no second resume
    assert_bit_exact(before, snapshot(big, opt))
    manager.sleep(parts=ALL_PARTS)
    free_all, _ = torch.cuda.mem_get_info()
    assert free_all - free_before >= 4 * 64 * 2**20 * 0.9  # and the gradients
    manager.wake_up()
    assert_bit_exact(before, snapshot(big, opt))
    with pytest.raises(ValueError, match="already used"):
        TorchMemorySaverBackend(device, name="tms")  # its tags would collide


def test_torch_memory_saver_moves_gradients_backward_made_outside_the_region(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("torch_memory_saver")
    model, opt = make(device="cuda")
    manager = OffloadManager(model, opt, backend="torch_memory_saver", name="stray")
    with manager.allocation_region(Part.GRADIENTS):
        loss_fn(model, batch(2, "cuda")).backward()  # runs on autograd's thread
    before = snapshot(model, opt)
    with caplog.at_level("WARNING", logger="ppo_lifecycle"):
        manager.sleep()
    assert "not in it" in caplog.text
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_torch_memory_saver_adopts_tensors_allocated_outside() -> None:
    pytest.importorskip("torch_memory_saver")
    model, opt = _trained_cuda()
    manager = OffloadManager(model, opt, backend="torch_memory_saver", name="adopt")
    params = list(model.parameters())
    before = snapshot(model, opt)
    manager.sleep()
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))
    assert list(model.parameters()) == params  # same objects, new storage in the region
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # still tied
    train_step(model, opt, seed=5)  # and training continues


def test_torch_memory_saver_wake_up_check_asks_for_what_the_pause_freed() -> None:
    """Small storages share one 2 MiB allocator segment, which torch_memory_saver pauses
    and resumes whole: the wake-up check asks for the segment, at least what the pause
    gave back to the device, not the storages' 64 KiB."""
    pytest.importorskip("torch_memory_saver")
    from ppo_lifecycle import TorchMemorySaverBackend

    device = torch.device("cuda", torch.cuda.current_device())
    backend = TorchMemorySaverBackend(device, name="tms-small")
    with backend.region(Part.PARAMETERS):
        small = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(256, device=device)) for _ in range(64)
        )  # 64 x 1 KiB
    backend.adopt_tensors(Part.PARAMETERS, small.parameters())
    opt = torch.optim.Adam(small.parameters(), lr=1e-3)
    manager = OffloadManager(small, opt, backend=backend, name="tms-small")
    before = snapshot(small, opt)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # nothing else of this process is freed by the sleep
    free_before, _ = torch.cuda.mem_get_info()
    manager.sleep(parts=[Part.PARAMETERS])
    freed = torch.cuda.mem_get_info()[0] - free_before
    asked = backend.resume_bytes(Part.PARAMETERS)  # what the wake-up will require
    assert asked >= 2 << 20 > 64 * 1024, asked
    assert asked >= freed > 0, (asked, freed)
    manager.wake_up()
    assert_bit_exact(before, snapshot(small, opt))
