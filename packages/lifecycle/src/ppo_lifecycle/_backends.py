"""Backends that move one part's storages off the device and back."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

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


class TorchMemorySaverBackend:
    """CUDA only: pause/resume ``torch_memory_saver`` regions, one tag per part.

    Storages are (re)allocated inside ``region(tag=f"{name}/{part}",
    enable_cpu_backup=...)``. A trainer can allocate directly in the right region
    with :meth:`region` (no copy at the first sleep); anything found outside is
    moved into its part's region once, at the first sleep that offloads it (the
    tensor objects are kept: ``Tensor.set_`` onto the new storage). Storages are
    recognised by identity; one freed and replaced at the same address outside the
    region would be missed by a pause (it stays resident, its contents intact).

    Args:
        device: a CUDA device.
        name: prefix of the tags (one manager per model: ``actor``, ``critic``).
        cpu_backup_parts: parts whose contents must survive a pause (default: all).
        hook_mode: ``torch_memory_saver`` hook mode; default ``preload`` when the
            process was started with its ``LD_PRELOAD`` hook, else ``torch``.
    """

    name = "torch_memory_saver"

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
        self._tms: Any = torch_memory_saver
        mode = hook_mode or (
            "preload" if "torch_memory_saver" in os.environ.get("LD_PRELOAD", "") else "torch"
        )
        with contextlib.suppress(AttributeError, AssertionError):
            # Only settable before the singleton's first use; later it keeps its mode.
            self._tms.hook_mode = mode
        self.device = device
        self.prefix = name
        self.cpu_backup_parts = cpu_backup_parts
        self._adopted: dict[Part, set[int]] = {part: set() for part in Part}
        self._paused: dict[Part, list[tuple[int, int]]] = {}

    def tag(self, part: Part) -> str:
        return f"{self.prefix}/{part.value}"

    @contextlib.contextmanager
    def region(self, part: Part) -> Iterator[None]:
        """Allocate inside ``part``'s pausable region."""
        with (
            torch.cuda.device(self.device),
            self._tms.region(tag=self.tag(part), enable_cpu_backup=part in self.cpu_backup_parts),
        ):
            yield

    def adopt(self, part: Part, keys: set[int]) -> None:
        """Record storage keys allocated inside ``part``'s region (no move needed)."""
        self._adopted[part].update(keys)

    def adopt_tensors(self, part: Part, tensors: Iterable[torch.Tensor]) -> None:
        """Record that ``tensors`` were allocated inside ``part``'s :meth:`region`."""
        self.adopt(part, {t.untyped_storage()._cdata for t in tensors})

    def offload(self, part: Part, groups: Sequence[StorageGroup]) -> int:
        """Move storages not yet in ``part``'s region into it, then pause the tag."""
        assert part not in self._paused, f"{part} paused twice"
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
        self._tms.pause(self.tag(part))
        self._paused[part] = released
        return sum(n for _, n in released)

    def reload(self, part: Part) -> int:
        assert part in self._paused, f"{part} resumed without being paused"
        self._tms.resume(self.tag(part))
        torch.cuda.synchronize(self.device)
        return sum(n for _, n in self._paused.pop(part))

    def offloaded_keys(self) -> frozenset[int]:
        return frozenset(key for items in self._paused.values() for key, _ in items)
