"""Round trips of a real tiny model and its real Adam through the host-copy backend."""

from __future__ import annotations

import logging

import pytest
import torch
from lifecycle_models import (
    TinyLM,
    assert_a_failed_sleep_kept_everything,
    assert_bit_exact,
    batch,
    loss_fn,
    make,
    snapshot,
    train_step,
)
from ppo_lifecycle import (
    ALL_PARTS,
    FORWARD_PARTS,
    KEEP_GRADIENTS,
    HostCopyBackend,
    Offloadable,
    OffloadManager,
    Part,
)
from ppo_lifecycle._backends import SpillTo, _Spill


def _trained() -> tuple[TinyLM, torch.optim.Adam]:
    model, opt = make()
    train_step(model, opt, seed=1)  # Adam state exists (exp_avg, exp_avg_sq, step)
    loss_fn(model, batch(2)).backward()  # and accumulated, un-applied gradients
    return model, opt


def test_manager_is_offloadable() -> None:
    model, opt = make()
    assert isinstance(OffloadManager(model, opt), Offloadable)


def test_round_trip_is_bit_exact_and_releases_storage() -> None:
    model, opt = _trained()
    manager = OffloadManager(model, opt, name="actor")
    before = snapshot(model, opt)
    resident = manager.device_bytes()
    params = list(model.parameters())
    exp_avg = [opt.state[p]["exp_avg"] for p in params]
    assert resident > 0

    manager.sleep()

    assert manager.is_asleep and manager.asleep_parts == ALL_PARTS
    assert manager.device_bytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(p.grad is not None and p.grad.untyped_storage().nbytes() == 0 for p in params)
    assert all(t.untyped_storage().nbytes() == 0 for t in exp_avg)
    assert model.temperature.untyped_storage().nbytes() == 0

    manager.wake_up()

    assert not manager.is_asleep
    assert manager.device_bytes() == resident
    assert_bit_exact(before, snapshot(model, opt))
    # The very same tensor objects are back in place: optimizer references hold.
    assert list(model.parameters()) == params
    assert all(opt.state[p]["exp_avg"] is t for p, t in zip(params, exp_avg, strict=True))


def test_tied_weights_move_once_and_stay_tied() -> None:
    model, opt = _trained()
    manager = OffloadManager(model, opt)
    tied_bytes = model.embed.weight.untyped_storage().nbytes()
    untied = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert manager.part_bytes()[Part.PARAMETERS] == untied  # parameters() yields it once
    manager.sleep()
    assert model.head.weight.untyped_storage().nbytes() == 0
    manager.wake_up()
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.embed.weight.untyped_storage().nbytes() == tied_bytes


def test_keep_gradients_sleep_keeps_accumulated_gradients() -> None:
    model, opt = _trained()
    manager = OffloadManager(model, opt)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    grad_bytes = manager.part_bytes()[Part.GRADIENTS]

    manager.sleep(parts=KEEP_GRADIENTS)

    assert manager.resident_parts == {Part.GRADIENTS}
    assert manager.device_bytes() == grad_bytes > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    # Gradients are usable while asleep (the driver may reduce them, clip them...).
    for p, g in zip(model.parameters(), grads, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)

    manager.wake_up()
    # Accumulate one more chunk on top: the sum is what a resident model would get.
    loss_fn(model, batch(3)).backward()
    reference, _ = _trained()
    loss_fn(reference, batch(3)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param(KEEP_GRADIENTS, id="keep-gradients"),
        pytest.param(ALL_PARTS, id="all"),
        pytest.param({Part.OPTIMIZER}, id="optimizer-only"),
    ],
)
def test_training_with_offload_matches_training_without(parts: frozenset[Part]) -> None:
    """Two chunks per step, offload between chunks and between steps, step for step."""
    plain, plain_opt = make(seed=7)
    model, opt = make(seed=7)
    manager = OffloadManager(model, opt)
    for step in range(3):
        for chunk in range(2):
            seed = 10 * step + chunk
            loss_fn(plain, batch(seed)).backward()
            loss_fn(model, batch(seed)).backward()
            manager.sleep(parts=parts)
            manager.wake_up()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        manager.sleep(parts=ALL_PARTS)
        manager.wake_up()
        assert_bit_exact(snapshot(plain, plain_opt), snapshot(model, opt))


def test_second_sleep_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained()
    calls: list[str] = []

    class Counting(HostCopyBackend):
        def offload(self, part, groups):  # type: ignore[no-untyped-def]
            calls.append(f"offload {part}")
            return super().offload(part, groups)

    manager = OffloadManager(model, opt, backend=Counting(torch.device("cpu")))
    manager.sleep(parts=KEEP_GRADIENTS)
    n = len(calls)
    with caplog.at_level(logging.INFO, logger="ppo_lifecycle"):
        manager.sleep(parts=KEEP_GRADIENTS)
    assert len(calls) == n
    assert "already asleep; skipping" in caplog.text
    # A wider sleep moves only what is still resident: the gradients.
    manager.sleep(parts=ALL_PARTS)
    assert calls[n:] == ["offload gradients"]
    assert manager.device_bytes() == 0


def test_wake_up_on_resident_model_only_reloads_process_groups(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _trained()
    events: list[str] = []
    manager = OffloadManager(
        model,
        opt,
        on_release_process_groups=lambda: events.append("release"),
        on_reload_process_groups=lambda: events.append("reload"),
    )
    before = snapshot(model, opt)
    with caplog.at_level(logging.INFO, logger="ppo_lifecycle"):
        manager.wake_up()
    assert events == ["reload"]
    assert "already resident" in caplog.text
    manager.sleep(parts=KEEP_GRADIENTS)
    manager.sleep(parts=ALL_PARTS)  # already asleep: groups are not released twice
    manager.wake_up()
    assert events == ["reload", "release", "reload"]
    assert_bit_exact(before, snapshot(model, opt))


def test_wake_up_forward_parts_leaves_the_rest_asleep(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained()
    reloads: list[str] = []
    manager = OffloadManager(
        model, opt, name="critic", on_reload_process_groups=lambda: reloads.append("reload")
    )
    before = snapshot(model, opt)
    sizes = manager.part_bytes()
    tokens = batch(5)
    with torch.no_grad():
        logits = model(tokens)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    manager.sleep()

    manager.wake_up(parts=FORWARD_PARTS)

    assert manager.resident_parts == FORWARD_PARTS
    assert manager.asleep_parts == {Part.OPTIMIZER, Part.GRADIENTS} and manager.is_asleep
    assert all(g is not None and g.untyped_storage().nbytes() == 0 for g in grads)
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    assert all(p.untyped_storage().nbytes() > 0 for p in params)
    assert manager.device_bytes() == sizes[Part.PARAMETERS] + sizes[Part.BUFFERS]
    assert manager.part_bytes() == sizes  # the asleep parts as they were put to sleep
    with torch.no_grad():
        assert torch.equal(model(tokens), logits)  # enough for a forward
    assert reloads == ["reload"]
    # Again: nothing moves, process groups only.
    with caplog.at_level(logging.INFO, logger="ppo_lifecycle"):
        manager.wake_up(parts=FORWARD_PARTS)
    assert "wake_up(parameters+buffers) while already resident" in caplog.text
    assert reloads == ["reload"] * 2
    assert manager.asleep_parts == {Part.OPTIMIZER, Part.GRADIENTS}
    # The rest comes back bit-exact, in the same tensor objects.
    manager.wake_up()
    assert not manager.is_asleep and reloads == ["reload"] * 3
    assert_bit_exact(before, snapshot(model, opt))
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert manager.device_bytes() == sum(sizes.values())


def test_wake_up_parts_are_validated() -> None:
    model, opt = _trained()
    manager = OffloadManager(model, opt)
    manager.sleep()
    with pytest.raises(ValueError, match="parts: empty selection"):
        manager.wake_up(parts=[])
    with pytest.raises(ValueError, match="parts: 'weights' is not a part"):
        manager.wake_up(parts=["parameters", "weights"])  # type: ignore[list-item]
    assert manager.asleep_parts == ALL_PARTS  # nothing moved
    manager.wake_up(parts=["optimizer"])  # type: ignore[list-item]  # names work too
    assert manager.asleep_parts == ALL_PARTS - {Part.OPTIMIZER}
    manager.wake_up()


def test_bad_parts_and_backend_are_named() -> None:
    model, opt = make()
    manager = OffloadManager(model, opt)
    with pytest.raises(ValueError, match="parts: 'weights' is not a part"):
        manager.sleep(parts=["weights"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="parts: empty selection"):
        manager.sleep(parts=[])
    with pytest.raises(ValueError, match="backend: 'nvme'"):
        OffloadManager(model, opt, backend="nvme")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not CUDA"):
        OffloadManager(model, opt, backend="torch_memory_saver")


@pytest.mark.parametrize(
    ("spill", "spill_to"),
    [(True, "process"), (True, "memfd"), (False, "auto")],
    ids=["spill-process", "spill-memfd", "in-process"],
)
def test_host_copies_freed_at_wake_up_or_cached(spill: bool, spill_to: SpillTo) -> None:
    model, opt = _trained()
    backend = HostCopyBackend(
        torch.device("cpu"), spill=spill, spill_to=spill_to, cache_host_buffers=False
    )
    manager = OffloadManager(model, opt, backend=backend)
    total = manager.device_bytes()
    manager.sleep()
    assert backend.host_bytes() == total
    manager.wake_up()
    assert backend.host_bytes() == 0
    cached = HostCopyBackend(
        torch.device("cpu"), spill=spill, spill_to=spill_to, cache_host_buffers=True
    )
    manager = OffloadManager(model, opt, backend=cached)
    before = snapshot(model, opt)
    for _ in range(2):  # the cached memory is reused
        manager.sleep()
        manager.wake_up()
        assert cached.host_bytes() == total
    assert_bit_exact(before, snapshot(model, opt))


def test_a_replaced_storage_leaves_no_cached_host_buffer_behind() -> None:
    """Cached host buffers are keyed by storage: a storage replaced between two sleeps
    (an optimizer state loaded, gradients set to None and made again) would otherwise
    keep its old buffer for good, and a new one would be made for its successor."""
    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill=False, cache_host_buffers=True)
    manager = OffloadManager(model, opt, backend=backend)
    total = manager.device_bytes()
    manager.sleep()
    manager.wake_up()
    assert backend.host_bytes() == total
    for state in opt.state.values():  # new storages, same sizes
        state["exp_avg"] = state["exp_avg"].clone()
    manager.sleep()
    assert backend.host_bytes() == total  # the replaced ones' buffers were dropped
    manager.wake_up()
    assert backend.host_bytes() == total


def test_cpu_default_spills_and_frees_the_copy_at_wake_up() -> None:
    backend = HostCopyBackend(torch.device("cpu"))
    assert backend.spill and not backend.cache_host_buffers and backend.spill_to == "auto"
    with pytest.raises(ValueError, match="spill_to: 'disk'"):
        HostCopyBackend(torch.device("cpu"), spill_to="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spill=True: device meta is not the CPU"):
        HostCopyBackend(torch.device("meta"), spill=True)
    with pytest.raises(ValueError, match="spill_files: 0"):
        HostCopyBackend(torch.device("cpu"), spill_files=0)


def test_new_optimizer_state_is_found_at_each_sleep() -> None:
    model, opt = make()
    manager = OffloadManager(model, opt)
    manager.sleep()  # no Adam state and no gradients yet
    manager.wake_up()
    train_step(model, opt, seed=4)  # Adam state appears now
    before = snapshot(model, opt)
    manager.sleep()
    assert all(
        t.untyped_storage().nbytes() == 0
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_rehome_keeps_tensor_objects_and_training_exact() -> None:
    """The memory-saver backend's move into a region, exercised on CPU storage."""
    from ppo_lifecycle._backends import rehome
    from ppo_lifecycle._tensors import collect_groups, inventory

    model, opt = _trained()
    plain, plain_opt = _trained()
    params = list(model.parameters())
    groups = collect_groups(list(Part), inventory(model, opt, torch.device("cpu")))
    for part_groups in groups.values():
        for group in part_groups:
            old_ptr = group.storage.data_ptr()
            fresh = torch.empty(group.nbytes, dtype=torch.uint8).untyped_storage()
            rehome(group, fresh)
            assert all(t.untyped_storage().data_ptr() != old_ptr for t in group.tensors)
    assert list(model.parameters()) == params
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert_bit_exact(snapshot(plain, plain_opt), snapshot(model, opt))
    for m, o in ((model, opt), (plain, plain_opt)):
        o.step()
        o.zero_grad(set_to_none=True)
        train_step(m, o, seed=9)
    assert_bit_exact(snapshot(plain, plain_opt), snapshot(model, opt))


def test_unresizable_storage_is_refused_before_anything_moves() -> None:
    # Optimizer state read straight from a file wraps a buffer that cannot be resized:
    # the sleep must refuse with a clear error and leave every part resident.
    model, opt = _trained()
    first = next(iter(model.parameters()))
    state = opt.state[first]
    wrapped = torch.frombuffer(bytearray(first.numel() * 4), dtype=torch.float32).view_as(first)
    wrapped.copy_(state["exp_avg"])
    state["exp_avg"] = wrapped
    assert not state["exp_avg"].untyped_storage().resizable()
    manager = OffloadManager(model, opt, name="actor")
    before = snapshot(model, opt)
    resident = manager.device_bytes()

    with pytest.raises(ValueError, match=r"not resizable.*nothing was moved.*clone"):
        manager.sleep()

    assert not manager.is_asleep
    assert manager.device_bytes() == resident
    assert_bit_exact(before, snapshot(model, opt))
    state["exp_avg"] = state["exp_avg"].clone()  # the documented fix
    manager.sleep()
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_spill_spreads_pieces_over_files_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_lifecycle import _backends

    monkeypatch.setattr(_backends, "_SPILL_CHUNK", 100)  # many pieces per storage
    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill_to="memfd", spill_files=3)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    total = manager.device_bytes()
    manager.sleep(parts=KEEP_GRADIENTS)
    spill = backend._spills[Part.OPTIMIZER]
    assert isinstance(spill, _Spill)
    assert len(spill.fds) == 3 and len({p.file for p in spill.pieces}) == 3
    assert max(p.length for p in spill.pieces) <= 100
    manager.sleep()
    assert backend.host_bytes() == total
    manager.wake_up()
    assert backend.host_bytes() == 0
    assert_bit_exact(before, snapshot(model, opt))


def test_spill_moves_many_pieces_per_call_and_resumes_short_transfers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small storages go to and from the files a batch per system call (at most
    ``_IOV_MAX`` buffers each), and a short transfer is resumed where it stopped."""
    import os

    from ppo_lifecycle import _backends

    monkeypatch.setattr(_backends, "_IOV_MAX", 3)
    calls = {"pwritev": 0, "preadv": 0}

    def short(name: str) -> object:
        real = getattr(os, name)

        def call(fd: int, buffers: list[memoryview], offset: int) -> int:
            calls[name] += 1
            assert len(buffers) <= 3
            head = [buffers[0][: max(1, len(buffers[0]) // 2)]]  # half the first buffer
            return int(real(fd, head, offset))

        return call

    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill_to="memfd", spill_files=1)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    count = len({t.untyped_storage()._cdata for t in manager._inventory()[Part.PARAMETERS]})
    assert count > 3
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwritev", short("pwritev"))
        patch.setattr(os, "preadv", short("preadv"))
        manager.sleep()
        manager.wake_up()
    assert calls["pwritev"] > count and calls["preadv"] > count  # halves, resumed
    assert_bit_exact(before, snapshot(model, opt))

    calls = {"pwritev": 0, "preadv": 0}

    def counted(name: str) -> object:
        real = getattr(os, name)

        def call(fd: int, buffers: list[memoryview], offset: int) -> int:
            calls[name] += 1
            assert len(buffers) <= 3
            return int(real(fd, buffers, offset))

        return call

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwritev", counted("pwritev"))
        patch.setattr(os, "preadv", counted("preadv"))
        manager.sleep(parts={Part.PARAMETERS})
        manager.wake_up()
    assert calls["pwritev"] == calls["preadv"] == -(-count // 3)  # one call per 3 storages
    assert_bit_exact(before, snapshot(model, opt))


def test_spill_read_of_a_truncated_copy_fails_loudly() -> None:
    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill_to="memfd", spill_files=1)
    manager = OffloadManager(model, opt, backend=backend)
    manager.sleep(parts={Part.PARAMETERS})
    import os

    spill = backend._spills[Part.PARAMETERS]
    assert isinstance(spill, _Spill)
    os.ftruncate(spill.fds[0], spill.nbytes() - 1)
    with pytest.raises(OSError, match="host copy ends early"):
        manager.wake_up()


def test_failed_spill_write_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill_to="memfd")
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    resident = manager.device_bytes()

    def full(*args: object) -> int:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwritev", full)
        with pytest.raises(OSError, match="No space left"):
            manager.sleep()
    assert_a_failed_sleep_kept_everything(manager, model, opt, before, resident)


def test_failed_wake_up_is_retried_from_the_spill(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill_to="memfd")
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    manager.sleep()
    real = os.preadv
    calls = [0]

    def flaky(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", flaky)
        with pytest.raises(OSError, match="Input/output"):
            manager.wake_up()
    assert manager.is_asleep and backend.host_bytes() > 0  # the copy is kept
    manager.wake_up()
    assert not manager.is_asleep and backend.host_bytes() == 0
    assert_bit_exact(before, snapshot(model, opt))


def test_release_goes_to_the_os_on_cpu_and_to_the_device_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import contextlib

    from ppo_lifecycle import _backends

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(_backends, "_malloc_trim", lambda: lambda pad: calls.append("trim"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    _backends.release_device_memory(torch.device("cpu"))
    assert calls == ["trim"]  # CPU runs never touch CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    _backends.release_device_memory(torch.device("cuda", 0))
    assert calls == ["trim"]  # no CUDA context made just to empty a cache
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    _backends.release_device_memory(torch.device("cuda", 0))
    assert calls == ["trim", "empty_cache"]
    # A sleep releases after moving, once per part that freed at least
    # CPU_TRIM_MIN_BYTES on a CPU "device". By default a model of a few KiB never trims
    # (its next pass would fault in again every free heap page, its reused activations
    # included).
    calls.clear()
    model, opt = _trained()
    OffloadManager(model, opt).sleep(parts={Part.OPTIMIZER, Part.PARAMETERS})
    assert calls == []
    # At a threshold between them: the parameters (P bytes) do not trim, the optimizer
    # (two Adam moments, 2 P) does.
    model, opt = _trained()
    manager = OffloadManager(model, opt)
    params = manager.part_bytes()[Part.PARAMETERS]
    monkeypatch.setattr(_backends.HostCopyBackend, "CPU_TRIM_MIN_BYTES", params + 1)
    manager.sleep(parts={Part.PARAMETERS})
    assert calls == []
    manager.sleep(parts={Part.OPTIMIZER})
    assert calls == ["trim"]


def test_rehome_keeps_each_view_at_its_offset() -> None:
    """Tensors that are views into one storage (a flat buffer and pieces of it, as a
    flattened parameter has) land at their own offsets in the new storage."""
    from ppo_lifecycle._backends import rehome
    from ppo_lifecycle._tensors import StorageGroup

    flat = torch.arange(12, dtype=torch.float32)
    block, tail = flat[2:6].view(2, 2), flat[6:]
    expected = [flat.clone(), block.clone(), tail.clone()]
    group = StorageGroup(flat.untyped_storage(), [flat, block, tail])
    fresh = torch.empty(group.nbytes, dtype=torch.uint8).untyped_storage()

    rehome(group, fresh)

    tensors = [flat, block, tail]
    assert all(t.untyped_storage().data_ptr() == fresh.data_ptr() for t in tensors)
    assert [t.storage_offset() for t in tensors] == [0, 2, 6]
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    block[0, 0] = -1.0  # still views of one storage
    assert flat[2].item() == -1.0


def test_a_cached_spill_shrinks_with_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached memfd files are reused by the next sleep; when the part has shrunk (some
    gradients set to None) the files it no longer fills are cut to what it needs, so
    the host holds the part's bytes, not the largest it ever was."""
    from ppo_lifecycle import _backends

    model, opt = _trained()
    backend = HostCopyBackend(
        torch.device("cpu"), spill_to="memfd", spill_files=3, cache_host_buffers=True
    )
    manager = OffloadManager(model, opt, backend=backend)
    grads = manager.part_bytes()[Part.GRADIENTS]
    # two and a half chunks: three files (at most spill_files, one per chunk begun)
    monkeypatch.setattr(_backends, "_SPILL_CHUNK", grads * 2 // 5)
    manager.sleep(parts={Part.GRADIENTS})
    spill = backend._spills[Part.GRADIENTS]
    assert isinstance(spill, _Spill)
    assert len(spill.fds) == 3 and {p.file for p in spill.pieces} == {0, 1, 2}
    manager.wake_up()
    assert backend.host_bytes() == grads  # kept for the next sleep

    model.embed.weight.grad = None
    model.hidden.weight.grad = None
    before = snapshot(model, opt)
    left = manager.part_bytes()[Part.GRADIENTS]
    assert 0 < left <= grads * 2 // 5  # one chunk's worth: one file
    manager.sleep(parts={Part.GRADIENTS})
    assert backend.host_bytes() == spill.nbytes() == left
    manager.wake_up()
    assert backend.host_bytes() == left
    assert_bit_exact(before, snapshot(model, opt))


def test_a_spill_write_that_stops_growing_fails_and_keeps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file that takes part of a buffer and then nothing more (``pwritev`` returns
    0) fails the sleep before any storage is released, and the bytes already written
    are freed."""
    import os

    model, opt = _trained()
    backend = HostCopyBackend(torch.device("cpu"), spill_to="memfd", spill_files=1)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    resident = manager.device_bytes()
    real = os.pwritev
    calls = [0]

    def stalls(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] == 1:  # half of the first buffer lands, then the file stops growing
            return int(real(fd, [buffers[0][: len(buffers[0]) // 2]], offset))
        return 0

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwritev", stalls)
        with pytest.raises(OSError, match="the host copy stopped growing"):
            manager.sleep()
    assert calls[0] == 2
    assert backend.host_bytes() == 0
    assert_a_failed_sleep_kept_everything(manager, model, opt, before, resident)


def test_a_part_that_frees_exactly_the_trim_threshold_trims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ppo_lifecycle import _backends

    trims: list[int] = []
    monkeypatch.setattr(_backends, "_malloc_trim", lambda: trims.append)
    model, opt = _trained()
    manager = OffloadManager(model, opt)
    params = manager.part_bytes()[Part.PARAMETERS]
    monkeypatch.setattr(_backends.HostCopyBackend, "CPU_TRIM_MIN_BYTES", params)
    manager.sleep(parts={Part.PARAMETERS})  # freed == the threshold: "at least"
    assert trims == [0]


def test_copies_wait_for_the_device_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the copies are asynchronous: a sleep waits for the device before its
    copies (what another stream still writes) and after them (before any storage is
    released), a wake-up once its copies are issued. CPU storages stand in for the
    device's; the synchronisations are recorded with what they would wait for."""
    from ppo_lifecycle._tensors import collect_groups, inventory

    model, opt = _trained()
    groups = collect_groups([Part.OPTIMIZER], inventory(model, opt, torch.device("cpu")))
    storages = [g.storage for g in groups[Part.OPTIMIZER]]
    contents = [torch.empty(0, dtype=torch.uint8).set_(s).clone() for s in storages]
    backend = HostCopyBackend(torch.device("cuda", 0), pin_memory=False)
    seen: list[tuple[int, bool]] = []

    def synchronize(device: torch.device | None = None) -> None:
        # (host buffers made so far, every storage resident with its own bytes)
        exact = all(
            s.nbytes() == c.numel() and torch.equal(torch.empty(0, dtype=torch.uint8).set_(s), c)
            for s, c in zip(storages, contents, strict=True)
        )
        seen.append((len(backend._cache), exact))

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    assert backend.offload(Part.OPTIMIZER, groups[Part.OPTIMIZER]) == sum(
        c.numel() for c in contents
    )
    n = len(storages)
    assert seen == [(0, True), (n, True)]
    assert all(s.nbytes() == 0 for s in storages)
    backend.reload(Part.OPTIMIZER)
    assert seen == [(0, True), (n, True), (n, True)]
