"""Backends that move one part's storages off the device and back."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from ._parts import Part
from ._tensors import StorageGroup

__all__ = ["HostCopyBackend", "OffloadBackend", "TorchMemorySaverBackend"]

logger = logging.getLogger("ppo_lifecycle")

BackendName = Literal["auto", "host_copy", "torch_memory_saver"]


@runtime_checkable
class OffloadBackend(Protocol):
    """Moves the storages of one part off the device and back.

    The manager calls ``offload(part, ...)`` only for a part that is resident and
    ``reload(part)`` only for a part that is offloaded; a backend may assert that.
    """

    name: str

    def offload(self, part: Part, groups: Sequence[StorageGroup]) -> int:
        """Release the storages of ``groups`` (one part) from the device; returns bytes."""
        ...

    def reload(self, part: Part) -> int:
        """Bring ``part`` back, contents bit-exact; returns bytes restored."""
        ...

    def offloaded_keys(self) -> frozenset[int]:
        """Storage keys currently off the device (all parts)."""
        ...


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8 [nbytes]`` tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rehome(group: StorageGroup, fresh: torch.UntypedStorage) -> torch.UntypedStorage:
    """Copy ``group``'s bytes into ``fresh`` and point every tensor of the group at it.

    The tensor objects stay the same (optimizer and module references hold); views
    of the old storage that are not in ``group.tensors`` would keep the old memory.
    """
    assert fresh.nbytes() == group.nbytes
    _byte_view(fresh).copy_(_byte_view(group.storage))
    with torch.no_grad():
        for tensor in group.tensors:
            tensor.set_(fresh, tensor.storage_offset(), tensor.size(), tensor.stride())
    return fresh


@dataclass
class _Saved:
    key: int
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor  # uint8 [nbytes] on the host


class HostCopyBackend:
    """Copy each storage to host memory, free it on the device, restore it in place.

    The device storage object is kept and resized (``resize_(0)`` on sleep, back to
    its size on wake), so every tensor, view, optimizer entry and autograd node that
    refers to it stays valid. On CUDA the host copies are pinned and the copies run
    asynchronously with one synchronisation per direction. On a CPU "device" the
    original storage is still released (resized to 0), so the release is real.

    Args:
        device: the device whose storages move (``cpu`` or ``cuda:N``).
        pin_memory: pin host copies; default: ``True`` on CUDA.
        cache_host_buffers: keep the host buffers while awake, so later sleeps
            reuse them (pinning and first-touch page faults are slow); default ``True``.
            ``False`` frees them at each wake-up (no host memory held while awake).
    """

    name = "host_copy"

    def __init__(
        self,
        device: torch.device,
        *,
        pin_memory: bool | None = None,
        cache_host_buffers: bool | None = None,
    ) -> None:
        self.device = device
        on_cuda = device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory is None else pin_memory
        self.cache_host_buffers = True if cache_host_buffers is None else cache_host_buffers
        self._saved: dict[Part, list[_Saved]] = {}
        self._cache: dict[int, torch.Tensor] = {}

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        cached = self._cache.get(key)
        if cached is not None and cached.numel() == nbytes:
            return cached
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
        if self.cache_host_buffers:
            self._cache[key] = buf
        return buf

    def check_releasable(self, part: Part, groups: Sequence[StorageGroup]) -> None:
        """Raise ValueError, before anything moves, if a storage cannot be freed.

        A storage that cannot be resized (a tensor wrapping a file or a foreign buffer)
        could be copied out but never released, and ``resize_`` would fail half-way.
        """
        fixed = [g for g in groups if not g.storage.resizable()]
        if fixed:
            raise ValueError(
                f"cannot offload {part.value}: {len(fixed)} storage(s) of "
                f"{sum(g.nbytes for g in fixed)} bytes are not resizable (tensors that wrap a "
                "file or an external buffer, e.g. straight from safetensors.load_file or "
                "torch.frombuffer); nothing was moved. Give them storage of their own first "
                "(tensor.clone()) when loading state into the model or optimizer"
            )

    def offload(self, part: Part, groups: Sequence[StorageGroup]) -> int:
        assert part not in self._saved, f"{part} offloaded twice"
        self.check_releasable(part, groups)
        saved: list[_Saved] = []
        for group in groups:
            storage, key, nbytes = group.storage, group.key, group.nbytes
            host = self._host_buffer(key, nbytes)
            host.untyped_storage().copy_(storage, non_blocking=self.pin_memory)
            saved.append(_Saved(key, storage, nbytes, host))
        _synchronize(self.device)
        # Only after every copy landed: free the device memory.
        for item in saved:
            item.storage.resize_(0)
        self._saved[part] = saved
        return sum(item.nbytes for item in saved)

    def reload(self, part: Part) -> int:
        assert part in self._saved, f"{part} reloaded without being offloaded"
        pending = self._saved[part]
        restored = 0
        for item in pending:
            # A retry after a failed wake-up skips storages already allocated.
            if item.storage.nbytes() != item.nbytes:
                item.storage.resize_(item.nbytes)
            item.storage.copy_(item.host.untyped_storage(), non_blocking=self.pin_memory)
            restored += item.nbytes
        _synchronize(self.device)
        del self._saved[part]
        return restored

    def offloaded_keys(self) -> frozenset[int]:
        return frozenset(item.key for items in self._saved.values() for item in items)

    def host_bytes(self) -> int:
        """Host memory held (offloaded copies plus cached buffers)."""
        keys = {id(item.host): item.nbytes for v in self._saved.values() for item in v}
        keys.update({id(buf): buf.numel() for buf in self._cache.values()})
        return sum(keys.values())


HookMode = Literal["preload", "torch"]

# torch_memory_saver 0.0.10 finds its preload hook as the one LD_PRELOAD entry whose
# path contains this (torch_memory_saver/hooks/mode_preload.py, get_path_binary).
_PRELOAD_MARK = "torch_memory_saver"


def _preloaded_hooks() -> list[str]:
    """The ``LD_PRELOAD`` entries that ``torch_memory_saver`` takes for its hook."""
    return [p for p in os.environ.get("LD_PRELOAD", "").split(":") if _PRELOAD_MARK in p]


def _resolve_hook_mode(tms: Any, requested: HookMode | None) -> HookMode:
    """Configure the singleton's hook mode (if still possible); return the mode in force.

    ``TorchMemorySaver.hook_mode`` is a write-only property that only works before
    the singleton's first use (``region``/``pause``/``resume`` build its implementation
    with the mode; later the setter fails). There is no environment variable for it.
    """
    impl = getattr(tms, "_impl", None)  # no public getter: reading hook_mode raises
    if impl is not None:  # already in use (this process made a region or paused before)
        active: HookMode | None = getattr(impl, "_hook_mode", None)
        if requested is not None and active is not None and active != requested:
            raise ValueError(
                f"hook_mode={requested!r}: torch_memory_saver is already in use in this "
                f"process with hook_mode={active!r}; the mode is fixed at its first use"
            )
        return active or requested or "torch"
    mode: HookMode = requested or ("preload" if _preloaded_hooks() else "torch")
    if mode == "preload" and len(_preloaded_hooks()) != 1:
        raise ValueError(
            "hook_mode='preload' needs the process started with exactly one torch_memory_saver "
            "hook in LD_PRELOAD (torch_memory_saver_hook_mode_preload_cu<N>.abi3.so; a parent "
            "can use torch_memory_saver.configure_subprocess()); "
            f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}. Or use hook_mode='torch'"
        )
    tms.hook_mode = mode
    return mode


def _expandable_segments_on() -> bool:
    return any(
        "expandable_segments:True" in os.environ.get(var, "")
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )


def _private_pool_ranges(device: torch.device) -> list[tuple[int, int]] | None:
    """Address ranges of ``device``'s caching-allocator segments owned by a private pool.

    ``torch_memory_saver`` regions are ``MemPool``s, so a storage allocated inside
    one lies in such a segment; one allocated in the default pool (``(0, 0)``) was
    not. ``None`` when this torch does not report segment pools.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    ranges: list[tuple[int, int]] = []
    segments: list[dict[str, Any]] = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    for segment in segments:
        if segment.get("device", index) != index:
            continue
        pool = segment.get("segment_pool_id")
        if pool is None:
            return None
        if tuple(pool) != (0, 0):
            address = int(segment["address"])
            ranges.append((address, address + int(segment["total_size"])))
    return ranges


class TorchMemorySaverBackend:
    """CUDA only: pause/resume ``torch_memory_saver`` regions, one tag per part.

    Storages are (re)allocated inside ``region(tag=f"{name}/{part}",
    enable_cpu_backup=...)``. A trainer can allocate directly in the right region
    with :meth:`region` (no copy at the first sleep); anything found outside is
    moved into its part's region once, at the first sleep that offloads it (the
    tensor objects are kept: ``Tensor.set_`` onto the new storage). Storages are
    recognised by identity; one freed and replaced at the same address outside the
    region would be missed by a pause (it stays resident, its contents intact).

    A region only captures allocations made by the thread that entered it (it is a
    ``torch.cuda.use_mem_pool`` plus a thread-local switch). ``backward()`` runs the
    CUDA part of autograd on its own thread, so gradients it creates inside a
    region are *not* in it: create them there yourself (``p.grad =
    torch.zeros_like(p)``; backward then accumulates in place). The first sleep that
    finds an adopted storage checks it against the allocator's private pools (one
    snapshot, not one per sleep); one that is not in a pool is moved like the
    others (logged).

    ``torch_memory_saver`` ends the process when asked to pause an allocation that
    is already paused, so two live backends may not share a ``name``, and nothing
    else in the process may call ``torch_memory_saver.pause()`` without a tag.
    ``expandable_segments`` must be off.

    Args:
        device: a CUDA device.
        name: prefix of the tags (one manager per model: ``actor``, ``critic``).
        cpu_backup_parts: parts whose contents must survive a pause (default: all).
        hook_mode: ``torch_memory_saver`` hook mode, fixed at the first use of its
            process-wide singleton; default ``preload`` when the process was started
            with its ``LD_PRELOAD`` hook, else ``torch``. Ignored (the mode in force
            is kept) when it was already in use, unless it contradicts an explicit one.

    Raises:
        ValueError: not CUDA, the extra is missing, ``name`` is taken by a live
            backend, expandable segments are on, or the hook mode cannot be had.
    """

    name = "torch_memory_saver"
    _live: ClassVar[weakref.WeakValueDictionary[str, TorchMemorySaverBackend]] = (
        weakref.WeakValueDictionary()
    )
    _paused_tags: ClassVar[set[str]] = set()  # process-wide, like the library's state

    def __init__(
        self,
        device: torch.device,
        *,
        name: str = "model",
        cpu_backup_parts: frozenset[Part] = frozenset(Part),
        hook_mode: HookMode | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"backend='torch_memory_saver': device {device} is not CUDA; "
                "use backend='host_copy' (or 'auto')"
            )
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ValueError(
                "backend='torch_memory_saver' needs the optional extra: "
                "pip install 'ppo-lifecycle[cuda]'"
            ) from exc
        if _expandable_segments_on():
            raise ValueError(
                "backend='torch_memory_saver' does not work with expandable_segments:True "
                "in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF; unset it or use "
                "backend='host_copy'"
            )
        if name in self._live:
            raise ValueError(
                f"backend='torch_memory_saver': name {name!r} is already used by a live "
                "backend in this process; its tags would collide (give each manager its "
                "own name, e.g. 'actor' and 'critic')"
            )
        self._tms: Any = torch_memory_saver
        self.hook_mode: HookMode = _resolve_hook_mode(self._tms, hook_mode)
        self.device = device
        self.prefix = name
        self.cpu_backup_parts = cpu_backup_parts
        self._adopted: dict[Part, set[int]] = {part: set() for part in Part}
        # adopted on the caller's word, not yet checked against the allocator's pools
        # (once checked, a storage keeps its address: later sleeps skip the snapshot)
        self._unchecked: dict[Part, set[int]] = {part: set() for part in Part}
        self._paused: dict[Part, list[tuple[int, int]]] = {}
        self._live[name] = self

    def tag(self, part: Part) -> str:
        return f"{self.prefix}/{part.value}"

    @contextlib.contextmanager
    def region(self, part: Part) -> Iterator[None]:
        """Allocate inside ``part``'s pausable region (this thread's allocations only)."""
        with (
            torch.cuda.device(self.device),
            self._tms.region(tag=self.tag(part), enable_cpu_backup=part in self.cpu_backup_parts),
        ):
            yield

    def adopt(self, part: Part, keys: set[int]) -> None:
        """Record storage keys allocated inside ``part``'s region (checked at the first
        sleep that finds them)."""
        self._adopted[part].update(keys)
        self._unchecked[part].update(keys)

    def adopt_tensors(self, part: Part, tensors: Iterable[torch.Tensor]) -> None:
        """Record that ``tensors`` were allocated inside ``part``'s :meth:`region`."""
        self.adopt(part, {t.untyped_storage()._cdata for t in tensors})

    def _outside_regions(self, part: Part, groups: Sequence[StorageGroup]) -> set[int]:
        """Keys of adopted, not yet checked storages in ``groups`` that lie in no private
        pool; the others of them are marked checked."""
        adopted = [g for g in groups if g.key in self._unchecked[part] and g.nbytes > 0]
        if not adopted:
            return set()
        self._unchecked[part] -= {g.key for g in adopted}
        ranges = _private_pool_ranges(self.device)
        if ranges is None:
            return set()
        return {
            g.key for g in adopted if not any(lo <= g.storage.data_ptr() < hi for lo, hi in ranges)
        }

    def offload(self, part: Part, groups: Sequence[StorageGroup]) -> int:
        """Move storages not yet in ``part``'s region into it, then pause the tag."""
        assert part not in self._paused, f"{part} paused twice"
        tag = self.tag(part)
        if tag in self._paused_tags:
            raise RuntimeError(
                f"torch_memory_saver tag {tag!r} is already paused by another backend; "
                "pausing it again would end the process"
            )
        stray = self._outside_regions(part, groups)
        if stray:
            logger.warning(
                "%s: %d storage(s) recorded as allocated in the %s region are not in it "
                "(allocated on another thread, e.g. by backward()?); moving them in now",
                self.prefix,
                len(stray),
                part.value,
            )
            self._adopted[part] -= stray
        released: list[tuple[int, int]] = []
        for group in groups:
            if group.key in self._adopted[part]:
                released.append((group.key, group.nbytes))
                continue
            with self.region(part):
                fresh = torch.empty(group.nbytes, dtype=torch.uint8, device=self.device)
            new_storage = rehome(group, fresh.untyped_storage())
            key: int = new_storage._cdata
            self._adopted[part].add(key)
            released.append((key, group.nbytes))
        torch.cuda.synchronize(self.device)
        self._tms.pause(tag)
        self._paused_tags.add(tag)
        self._paused[part] = released
        return sum(n for _, n in released)

    def reload(self, part: Part) -> int:
        assert part in self._paused, f"{part} resumed without being paused"
        tag = self.tag(part)
        self._tms.resume(tag)
        self._paused_tags.discard(tag)
        torch.cuda.synchronize(self.device)
        return sum(n for _, n in self._paused.pop(part))

    def offloaded_keys(self) -> frozenset[int]:
        return frozenset(key for items in self._paused.values() for key, _ in items)
