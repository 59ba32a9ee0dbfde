"""The torch_memory_saver backend's own logic, on CPU with a stand-in for the library.

The library needs CUDA (its regions are CUDA memory pools), so here a stand-in records
the calls and the device hooks are replaced; ``test_lifecycle_gpu.py`` and the
cross-process test in ``test_lifecycle_memory.py`` run the real library on a GPU.
What is checked here is what this package decides: which storages move into a region
and when their old blocks are freed, what counts as already in a region, and when to
refuse instead of letting the library end the process.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from lifecycle_models import assert_bit_exact, make, snapshot, train_step
from ppo_lifecycle import (
    ALL_PARTS,
    FORWARD_PARTS,
    OffloadManager,
    Part,
    TorchMemorySaverBackend,
    _backends,
)


class _StandIn:
    """Records ``region`` / ``pause`` / ``resume``; the hook mode is write-only upstream."""

    def __init__(self) -> None:
        self._impl = None
        self.calls: list[tuple[str, str]] = []
        self.modes: list[str] = []

    @property
    def hook_mode(self) -> str:
        raise AttributeError("write-only, as upstream")

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        self.modes.append(mode)

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool) -> Iterator[None]:
        assert enable_cpu_backup
        self.calls.append(("region", tag))
        yield

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


class _Device:
    """The device hooks: free bytes as set by the test, and each cache release with
    how many of the watched (pre-move) storages were still alive at that moment."""

    def __init__(self) -> None:
        self.free = 1 << 40
        self.watched: list[int] = []
        self.alive_at_release: list[int] = []

    def release(self, device: torch.device) -> None:
        self.alive_at_release.append(
            sum(not torch.UntypedStorage._expired(h) for h in self.watched)  # type: ignore[attr-defined]
        )


@pytest.fixture
def saver(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_StandIn, _Device]]:
    tms = _StandIn()
    device = _Device()
    monkeypatch.setitem(
        sys.modules,
        "torch_memory_saver",
        types.SimpleNamespace(torch_memory_saver=tms),
    )
    monkeypatch.setattr(torch.cuda, "device", lambda _d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda _d=None: None)
    monkeypatch.setattr(_backends, "device_free_bytes", lambda _d: device.free)
    monkeypatch.setattr(_backends, "release_device_memory", device.release)
    monkeypatch.setattr(_backends, "_private_pool_ranges", lambda _d: None)
    monkeypatch.setattr(_backends, "_device_segments", lambda _d: [])  # no pools reported
    yield tms, device
    for handle in device.watched:
        torch.UntypedStorage._free_weak_ref(handle)  # type: ignore[attr-defined]


def _manager(name: str) -> tuple[OffloadManager, torch.nn.Module, torch.optim.Adam]:
    model, opt = make()
    train_step(model, opt, seed=1)  # Adam state exists
    backend = TorchMemorySaverBackend(torch.device("cuda", 0), name=name)
    backend.device = torch.device("cpu")  # the stand-in's "CUDA" memory is host memory
    return OffloadManager(model, opt, backend=backend, keep_gradients=False), model, opt


def _storages(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.UntypedStorage]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    unique = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
    return list(unique.values())


def test_first_sleep_frees_each_old_block_as_it_goes(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    tms, device = saver
    manager, model, opt = _manager("tms-free")
    before = snapshot(model, opt)
    old = _storages(model, opt)
    device.watched = [s._weak_ref() for s in old]  # type: ignore[attr-defined]
    # empty the cache after every ~2 storages moved: the releases come before the end
    monkeypatch.setattr(TorchMemorySaverBackend, "RELEASE_EVERY_BYTES", 2 * 16 * 16 * 4)
    del old
    manager.sleep()
    alive = device.alive_at_release
    assert len(alive) >= 3, alive
    # an old block is freed as soon as its copy is in the region: each release sees
    # fewer of them alive, the first already fewer than all, the last none
    assert alive == sorted(alive, reverse=True), alive
    assert alive[0] < len(device.watched) and alive[-1] == 0, alive
    paused = [tag for call, tag in tms.calls if call == "pause"]
    assert sorted(paused) == sorted(f"tms-free/{p.value}" for p in Part)
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_a_replaced_storage_is_moved_into_the_region_again(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, model, opt = _manager("tms-replaced")
    in_region: set[int] = set()
    rehome = _backends.rehome

    def recording_rehome(group: object, fresh: torch.UntypedStorage) -> torch.UntypedStorage:
        in_region.add(fresh.data_ptr())
        return rehome(group, fresh)  # type: ignore[arg-type]

    monkeypatch.setattr(_backends, "rehome", recording_rehome)
    manager.sleep()
    manager.wake_up()
    # replace every optimizer-state storage (as load_state_dict does): the old ones are
    # freed, and Python often hands their keys to the new ones
    for state in opt.state.values():
        for k, v in list(state.items()):
            state[k] = v.clone()
    expected = snapshot(model, opt)
    manager.sleep()
    for storage in _storages(model, opt):
        assert storage.data_ptr() in in_region, "a storage outside the region was paused"
    manager.wake_up()
    assert_bit_exact(expected, snapshot(model, opt))


def test_no_room_raises_instead_of_ending_the_process_and_can_be_retried(
    saver: tuple[_StandIn, _Device],
) -> None:
    tms, device = saver
    manager, model, opt = _manager("tms-room")
    before = snapshot(model, opt)
    device.free = 0
    with pytest.raises(RuntimeError, match="put the other model to sleep first"):
        manager.sleep()
    assert not manager.is_asleep and not [c for c in tms.calls if c[0] == "pause"]
    device.free = 1 << 40
    manager.sleep()
    assert manager.asleep_parts == ALL_PARTS
    device.free = 0
    with pytest.raises(RuntimeError, match="waking"):
        manager.wake_up(parts=FORWARD_PARTS)
    assert manager.asleep_parts == ALL_PARTS
    assert not [c for c in tms.calls if c[0] == "resume"]
    device.free = 1 << 40
    manager.wake_up()
    assert not manager.is_asleep
    assert_bit_exact(before, snapshot(model, opt))


def test_a_wake_up_counts_the_regions_whole_segments(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_memory_saver resumes a region's whole allocator segments, which hold more
    than its storages (small ones share 2 MiB segments): the wake-up check asks for
    what the sleep found in the pools of the part's storages, not their bytes."""
    _, device = saver
    manager, model, opt = _manager("tms-segments")
    segment, spare, pool = 2 << 20, 64 << 20, (1, 7)
    in_region: list[int] = []  # addresses of the storages moved into the region

    def segments(_device: torch.device) -> list[dict[str, object]]:
        # a segment per storage in the region's pool, a spare one there (free blocks the
        # region still maps), and the default pool's, which a resume never maps back
        out: list[dict[str, object]] = [
            {"address": ptr, "total_size": segment, "segment_pool_id": pool} for ptr in in_region
        ]
        out.append({"address": 1, "total_size": spare, "segment_pool_id": pool})
        out.append({"address": 2, "total_size": 1 << 30, "segment_pool_id": (0, 0)})
        return out

    rehome = _backends.rehome

    def into_region(group: object, fresh: torch.UntypedStorage) -> torch.UntypedStorage:
        in_region.append(fresh.data_ptr())
        return rehome(group, fresh)  # type: ignore[arg-type]

    monkeypatch.setattr(_backends, "rehome", into_region)
    monkeypatch.setattr(_backends, "_device_segments", segments)
    before = snapshot(model, opt)
    manager.sleep(parts=[Part.OPTIMIZER])
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    }
    assert len(in_region) == len(storages)
    mapped = len(in_region) * segment + spare
    headroom = TorchMemorySaverBackend.HEADROOM_BYTES
    device.free = sum(storages.values()) + headroom  # room for the storages, not the segments
    with pytest.raises(RuntimeError, match=rf"waking optimizer needs {mapped + headroom} bytes"):
        manager.wake_up()
    assert manager.asleep_parts == {Part.OPTIMIZER}
    device.free = mapped + headroom
    manager.wake_up()
    assert not manager.is_asleep
    assert_bit_exact(before, snapshot(model, opt))


def test_allocation_region_refuses_a_sleeping_part(saver: tuple[_StandIn, _Device]) -> None:
    manager, _, _ = _manager("tms-region")
    manager.sleep()
    refused = pytest.raises(RuntimeError, match=r"wake_up\(parts=\[Part.OPTIMIZER\]\) first")
    with refused, manager.allocation_region(Part.OPTIMIZER):
        pass
    manager.wake_up()
    with manager.allocation_region(Part.OPTIMIZER):
        pass


def test_the_backends_own_region_refuses_a_sleeping_part(saver: tuple[_StandIn, _Device]) -> None:
    """``backend.region`` is public (allocating before the manager exists): while the
    part sleeps it refuses too, before the library hands out paused memory."""
    tms, _ = saver
    manager, _, _ = _manager("tms-own-region")
    backend = manager.backend
    manager.sleep()
    before = list(tms.calls)
    refused = pytest.raises(RuntimeError, match=r"tms-own-region/optimizer is asleep")
    with refused, backend.region(Part.OPTIMIZER):
        pass
    assert tms.calls == before  # the library was not asked
    manager.wake_up()
    with backend.region(Part.OPTIMIZER):
        pass
    assert tms.calls[-1] == ("region", "tms-own-region/optimizer")


def test_a_second_backend_cannot_change_the_hook_mode_before_first_use(
    saver: tuple[_StandIn, _Device],
) -> None:
    tms, _ = saver
    first = TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-a", hook_mode="torch")
    assert first.hook_mode == "torch" and tms.modes == ["torch"]
    with pytest.raises(ValueError, match="already has hook_mode='torch'"):
        TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-b", hook_mode="preload")
    second = TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-c")
    assert second.hook_mode == "torch" and tms.modes == ["torch"]


class _Library:
    """The singleton's C library: records the region flag the exit hook sets."""

    def __init__(self) -> None:
        self.interesting: list[bool] = []

    def tms_set_interesting_region(self, value: bool) -> None:
        self.interesting.append(value)


class _RetainingStandIn(_StandIn):
    """A stand-in with 0.0.10's process-wide ``retain_cpu_backup`` and C library."""

    def __init__(self) -> None:
        super().__init__()
        self.retained: list[bool] = []
        self._impl = types.SimpleNamespace(  # type: ignore[assignment]
            _hook_mode="torch", _binary_wrapper=types.SimpleNamespace(cdll=_Library())
        )

    @property
    def retain_cpu_backup(self) -> bool:
        return bool(self.retained and self.retained[-1])

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self.retained.append(value)


def test_torch_hook_mode_exits_cleanly_and_host_copies_are_retained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen on an H200: in ``torch`` hook mode the pools' frees at interpreter exit
    ended every process with status 1, and the CPU backups were pinned anew at each
    sleep (1.8 s for 3 GiB). One exit hook per singleton marks the exiting thread as in
    a region; retention is asked for unless the caller declines."""
    tms = _RetainingStandIn()
    monkeypatch.setitem(
        sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=tms)
    )
    hooks: list[Callable[[], None]] = []
    monkeypatch.setattr(_backends.atexit, "register", hooks.append)
    first = TorchMemorySaverBackend(torch.device("cuda", 0), name="exit-a")
    second = TorchMemorySaverBackend(
        torch.device("cuda", 0), name="exit-b", retain_host_copies=False
    )
    assert first.hook_mode == second.hook_mode == "torch"
    assert len(hooks) == 1  # once per process's singleton
    assert first.retain_host_copies and not second.retain_host_copies
    assert tms.retained == [True]  # never turned off by a backend that declines
    library = tms._impl._binary_wrapper.cdll
    assert library.interesting == []  # nothing changes until the exit
    hooks[0]()
    assert library.interesting == [True]


def test_retention_is_not_asked_for_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_memory_saver 0.0.10 ends the process when retention is turned on in a ROCm
    build ("CUDA-only"), though the setting exists there too."""
    tms = _RetainingStandIn()
    monkeypatch.setitem(
        sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=tms)
    )
    monkeypatch.setattr(_backends.atexit, "register", lambda _hook: None)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    backend = TorchMemorySaverBackend(torch.device("cuda", 0), name="rocm")
    assert not backend.retain_host_copies and tms.retained == []


def test_a_library_without_retention_is_used_as_it_is(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks: list[Callable[[], None]] = []
    monkeypatch.setattr(_backends.atexit, "register", hooks.append)
    backend = TorchMemorySaverBackend(torch.device("cuda", 0), name="no-retain")
    assert not backend.retain_host_copies
    for hook in hooks:
        hook()  # no C library yet (the stand-in's _impl is None): nothing to mark


def test_storages_already_in_their_region_are_not_moved_again(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage moved into its region at the first sleep is recognised there (same
    storage, same address) at the next one: nothing is copied twice."""
    manager, model, opt = _manager("tms-again")
    moved: list[int] = []
    rehome = _backends.rehome

    def counted(group: object, fresh: torch.UntypedStorage) -> torch.UntypedStorage:
        moved.append(fresh.nbytes())
        return rehome(group, fresh)  # type: ignore[arg-type]

    monkeypatch.setattr(_backends, "rehome", counted)
    manager.sleep()
    manager.wake_up()
    assert len(moved) == len(_storages(model, opt))
    pointers = [s.data_ptr() for s in _storages(model, opt)]
    before = snapshot(model, opt)
    first = len(moved)
    manager.sleep()
    assert len(moved) == first
    manager.wake_up()
    assert [s.data_ptr() for s in _storages(model, opt)] == pointers
    assert_bit_exact(before, snapshot(model, opt))


def test_adopted_storages_in_a_private_pool_stay_and_the_others_move(
    saver: tuple[_StandIn, _Device],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Storages adopted as allocated in a region are checked against the allocator's
    private pools at the first sleep: one inside a pool's segment stays where it is,
    the others (allocated elsewhere, e.g. by backward()) are moved in, logged."""
    manager, model, opt = _manager("tms-adopt")
    params = list(model.parameters())
    manager.backend.adopt_tensors(Part.PARAMETERS, params)
    kept = model.hidden.weight.untyped_storage()
    start = kept.data_ptr()
    monkeypatch.setattr(
        _backends, "_private_pool_ranges", lambda _d: [(start, start + kept.nbytes())]
    )
    pointers = [p.data_ptr() for p in params]
    before = snapshot(model, opt)
    with caplog.at_level(logging.WARNING, logger="ppo_lifecycle"):
        manager.sleep(parts=[Part.PARAMETERS])
    after = [p.data_ptr() for p in params]
    assert [a == b for a, b in zip(after, pointers, strict=True)] == [
        p is model.hidden.weight for p in params
    ]
    stray = len(params) - 1
    assert f"{stray} storage(s) recorded as allocated in the parameters region" in caplog.text
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_the_cache_is_emptied_each_time_release_every_bytes_were_moved(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a part's first sleep the old blocks go back to the device each time
    another ``RELEASE_EVERY_BYTES`` were moved (not after every storage once past
    it), and once more after the pause."""
    tms, _ = saver
    manager, _, _ = _manager("tms-cadence")
    every = 1024
    monkeypatch.setattr(TorchMemorySaverBackend, "RELEASE_EVERY_BYTES", every)
    events: list[int | str] = []
    rehome = _backends.rehome

    def moving(group: object, fresh: torch.UntypedStorage) -> torch.UntypedStorage:
        events.append(fresh.nbytes())
        return rehome(group, fresh)  # type: ignore[arg-type]

    monkeypatch.setattr(_backends, "rehome", moving)
    monkeypatch.setattr(_backends, "release_device_memory", lambda _d: events.append("release"))
    monkeypatch.setattr(tms, "pause", lambda tag: events.append("pause"))
    manager.sleep()
    since = 0
    for i, event in enumerate(events):
        if isinstance(event, int):
            since += event
            assert (events[i + 1] == "release") is (since >= every), (i, events)
            if since >= every:
                since = 0
        elif event == "pause":
            assert events[i + 1] == "release", events
            since = 0  # each part counts afresh
    assert events.count("pause") == len(Part)  # every tag, the empty gradients' too
    # the premise: some storage moved after a release does not reach the threshold
    assert any(
        isinstance(e, int) and e < every and events[i - 1] == "release"
        for i, e in enumerate(events)
    )


def test_a_wake_up_needs_the_storages_bytes_plus_headroom_and_no_more(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where this torch reports no segment pools, a wake-up asks for the part's bytes
    plus ``HEADROOM_BYTES``; exactly that much free is enough, before or after
    emptying this process's cache."""
    _, device = saver
    manager, model, opt = _manager("tms-exact")
    before = snapshot(model, opt)
    manager.sleep(parts=[Part.OPTIMIZER])
    need = manager.part_bytes()[Part.OPTIMIZER] + TorchMemorySaverBackend.HEADROOM_BYTES
    releases: list[int] = []

    def release(_device: torch.device) -> None:
        releases.append(device.free)

    monkeypatch.setattr(_backends, "release_device_memory", release)
    device.free = need - 1
    with pytest.raises(RuntimeError, match=rf"waking optimizer needs {need} bytes"):
        manager.wake_up()
    assert releases == [need - 1] and manager.asleep_parts == {Part.OPTIMIZER}
    device.free = need  # enough at once: the cache is not emptied
    manager.wake_up()
    assert releases == [need - 1] and not manager.is_asleep
    assert_bit_exact(before, snapshot(model, opt))

    manager.sleep(parts=[Part.OPTIMIZER])
    releases.clear()
    device.free = need - 1

    def frees_exactly_enough(_device: torch.device) -> None:
        releases.append(device.free)
        device.free = need

    monkeypatch.setattr(_backends, "release_device_memory", frees_exactly_enough)
    manager.wake_up()
    assert releases == [need - 1] and not manager.is_asleep
    assert_bit_exact(before, snapshot(model, opt))


def test_a_wake_up_counts_only_its_own_regions_segments(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another region's pool (another part's, another model's) is not mapped back by
    this part's resume: its segments are not counted."""
    manager, _, _ = _manager("tms-own-pool")
    segment, pool, other = 2 << 20, (1, 7), (1, 8)
    in_region: list[int] = []
    rehome = _backends.rehome

    def into_region(group: object, fresh: torch.UntypedStorage) -> torch.UntypedStorage:
        in_region.append(fresh.data_ptr())
        return rehome(group, fresh)  # type: ignore[arg-type]

    def segments(_device: torch.device) -> list[dict[str, object]]:
        out: list[dict[str, object]] = [
            {"address": ptr, "total_size": segment, "segment_pool_id": pool} for ptr in in_region
        ]
        out.append({"address": 1, "total_size": 64 << 20, "segment_pool_id": other})
        return out

    monkeypatch.setattr(_backends, "rehome", into_region)
    monkeypatch.setattr(_backends, "_device_segments", segments)
    manager.sleep(parts=[Part.OPTIMIZER])
    assert in_region
    assert manager.backend.resume_bytes(Part.OPTIMIZER) == len(in_region) * segment
    manager.wake_up()


def test_segments_are_those_of_the_backends_device(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot_ = [
        {"device": 0, "address": 10, "total_size": 2, "segment_pool_id": (1, 1)},
        {"device": 1, "address": 20, "total_size": 4, "segment_pool_id": (1, 2)},
        {"device": 1, "address": 30, "total_size": 8, "segment_pool_id": (0, 0)},
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot_)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _backends._device_segments(torch.device("cuda", 0)) == snapshot_[:1]
    assert _backends._device_segments(torch.device("cuda", 1)) == snapshot_[1:]
    assert _backends._device_segments(torch.device("cuda")) == snapshot_[1:]  # the current one
    assert _backends._private_pool_ranges(torch.device("cuda", 1)) == [(20, 24)]


def test_only_the_parts_named_keep_a_cpu_backup(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    tms, _ = saver
    regions: dict[str, bool] = {}

    @contextlib.contextmanager
    def region(tag: str, enable_cpu_backup: bool) -> Iterator[None]:
        regions[tag] = enable_cpu_backup
        yield

    monkeypatch.setattr(tms, "region", region)
    model, opt = make()
    train_step(model, opt, seed=1)
    backend = TorchMemorySaverBackend(
        torch.device("cuda", 0),
        name="tms-backup",
        cpu_backup_parts=frozenset({Part.PARAMETERS, Part.OPTIMIZER}),
    )
    backend.device = torch.device("cpu")
    manager = OffloadManager(model, opt, backend=backend, keep_gradients=False)
    manager.sleep()
    assert regions == {
        "tms-backup/parameters": True,
        "tms-backup/optimizer": True,
        "tms-backup/buffers": False,
    }
    manager.wake_up()


def test_a_name_is_refused_while_live_and_a_tag_while_paused(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two live backends may not share a name; and a tag left paused by a backend that
    is gone (the library still holds it paused) is refused by the next one, which
    would otherwise make the library end the process."""
    import gc

    monkeypatch.setattr(TorchMemorySaverBackend, "_paused_tags", set())
    tms, _ = saver
    manager, _, _ = _manager("tms-gone")
    with pytest.raises(ValueError, match="name 'tms-gone' is already used by a live backend"):
        TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-gone")
    manager.sleep(parts=[Part.OPTIMIZER])
    del manager
    gc.collect()
    again, _, _ = _manager("tms-gone")  # the name is free once its backend is gone
    pauses = [c for c in tms.calls if c[0] == "pause"]
    refused = "tag 'tms-gone/optimizer' is already paused by another backend"
    with pytest.raises(RuntimeError, match=refused):
        again.sleep(parts=[Part.OPTIMIZER])
    assert [c for c in tms.calls if c[0] == "pause"] == pauses
    again.sleep(parts=[Part.PARAMETERS])  # another tag
    again.wake_up()


def test_the_default_hook_mode_follows_ld_preload(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    tms, _ = saver
    hook = "/site/torch_memory_saver_hook_mode_preload_cu12.abi3.so"
    monkeypatch.setenv("LD_PRELOAD", f"/lib/other.so:{hook}")
    backend = TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-preload")
    assert backend.hook_mode == "preload" and tms.modes == ["preload"]


@pytest.mark.parametrize("preload", ["", "/a/torch_memory_saver_a.so:/b/torch_memory_saver_b.so"])
def test_preload_hook_mode_needs_exactly_one_hook(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch, preload: str
) -> None:
    tms, _ = saver
    monkeypatch.setenv("LD_PRELOAD", preload)
    with pytest.raises(ValueError, match="exactly one torch_memory_saver hook in LD_PRELOAD"):
        TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-hooks", hook_mode="preload")
    assert tms.modes == []


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_are_refused_among_other_settings(
    saver: tuple[_StandIn, _Device], monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, "garbage_collection_threshold:0.6,expandable_segments:True")
    with pytest.raises(ValueError, match="does not work with expandable_segments:True"):
        TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-expandable")
    monkeypatch.setenv(var, "garbage_collection_threshold:0.6,expandable_segments:False")
    TorchMemorySaverBackend(torch.device("cuda", 0), name="tms-expandable")
