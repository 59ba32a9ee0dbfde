"""Refusing to keep gradients that share storage with what leaves the device."""

from __future__ import annotations

import pytest
import torch
from lifecycle_models import assert_bit_exact, make, snapshot, train_step
from ppo_lifecycle import (
    ALL_PARTS,
    FORWARD_PARTS,
    KEEP_GRADIENTS,
    OffloadManager,
    Part,
    StorageAliasError,
    check_gradient_isolation,
)


def _shared_buffer_model() -> tuple[torch.nn.Module, torch.optim.Adam]:
    """Parameters living inside the gradient buffer (MXFP8 + distributed optimizer)."""
    model, opt = make()
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    with torch.no_grad():
        for p in params:
            view = buffer[offset : offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            p.main_grad = view  # type: ignore[attr-defined]
            offset += p.numel()
    return model, opt


def _separate_buffer_model() -> tuple[torch.nn.Module, torch.optim.Adam, torch.Tensor]:
    """Megatron-style contiguous gradient buffer of its own: allowed."""
    model, opt = make()
    params = list(model.parameters())
    grad_buffer = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.main_grad = grad_buffer[offset : offset + p.numel()].view_as(p)  # type: ignore[attr-defined]
        offset += p.numel()
    return model, opt, grad_buffer


def test_shared_storage_is_refused_at_set_up() -> None:
    model, opt = _shared_buffer_model()
    with pytest.raises(StorageAliasError, match="keep_gradients=True: gradient storage overlaps"):
        OffloadManager(model, opt)
    with pytest.raises(ValueError, match="parameters"):
        check_gradient_isolation(model, opt)


def test_shared_storage_is_allowed_without_keeping_gradients() -> None:
    model, opt = _shared_buffer_model()
    manager = OffloadManager(model, opt, keep_gradients=False)
    before = snapshot(model, opt)
    # A keep-gradients sleep is refused before anything moves...
    with pytest.raises(StorageAliasError, match="gradients \\(kept\\) <-> parameters"):
        manager.sleep(parts=KEEP_GRADIENTS)
    assert not manager.is_asleep
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    # ... while offloading everything together is sound.
    manager.sleep(parts=ALL_PARTS)
    assert manager.device_bytes() == 0
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_partial_wake_up_brings_back_the_part_that_owns_a_shared_storage() -> None:
    """The parameters live in the gradient buffer, which sleeps as part of the
    gradients (the first of the two in PART_ORDER): waking the forward parts must bring
    that storage back too, and a later full sleep and wake-up stay bit exact."""
    model, opt = _shared_buffer_model()
    train_step(model, opt, seed=1)
    manager = OffloadManager(model, opt, keep_gradients=False)
    before = snapshot(model, opt)
    manager.sleep()
    manager.wake_up(parts=FORWARD_PARTS)
    assert manager.asleep_parts == {Part.OPTIMIZER}  # the gradients came along
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[f"model.{name}"]), name
    manager.sleep()  # everything again, the shared storage once
    assert manager.device_bytes() == 0
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_separate_gradient_buffer_stays_resident() -> None:
    model, opt, grad_buffer = _separate_buffer_model()
    grad_buffer.normal_()
    expected = grad_buffer.clone()
    manager = OffloadManager(model, opt)  # no refusal
    manager.sleep(parts=KEEP_GRADIENTS)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert grad_buffer.untyped_storage().nbytes() == expected.numel() * 4
    assert manager.part_bytes()[Part.GRADIENTS] == expected.numel() * 4
    grad_buffer.add_(1.0)  # still usable while the parameters are away
    manager.wake_up()
    assert torch.equal(grad_buffer, expected + 1.0)


def test_aliasing_that_appears_after_set_up_is_refused_at_sleep() -> None:
    model, opt = make()
    train_step(model, opt, seed=1)
    manager = OffloadManager(model, opt)
    first = next(model.parameters())
    first.grad = first.data  # a bug elsewhere made grad alias the parameter
    with pytest.raises(StorageAliasError, match="would move memory that a kept part uses"):
        manager.sleep(parts=KEEP_GRADIENTS)
    assert not manager.is_asleep
