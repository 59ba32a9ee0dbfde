"""Backends that move one part's storages off the device (sleep) and back (wake_up)."""

from __future__ import annotations

import atexit
import bisect
import contextlib
import ctypes
import functools
import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from ._host_process import HostProcess, HostProcessError, shared_host_process
from ._parts import Part
from ._tensors import StorageGroup

__all__ = ["HostCopyBackend", "OffloadBackend", "TorchMemorySaverBackend"]

logger = logging.getLogger("ppo_lifecycle")

BackendName = Literal["auto", "host_copy", "torch_memory_saver"]


@runtime_checkable
class OffloadBackend(Protocol):
    """Moves the storages of one part off the device and back: the mechanism under
    :meth:`OffloadManager.sleep` (``offload``) and :meth:`OffloadManager.wake_up`
    (``reload``), one part at a time.

    The manager calls ``offload(part, ...)`` only for a part that is resident and
    ``reload(part)`` only for a part that is asleep; a backend may assert that. After
    ``offload`` the memory must be usable by another process on the same device.
    """

    name: str

    def offload(self, part: Part, groups: Sequence[StorageGroup]) -> int:
        """Release the storages of ``groups`` (one part) from the device; returns bytes."""
        ...

    def reload(self, part: Part) -> int:
        """Bring ``part`` back, contents bit-exact; returns bytes restored."""
        ...

    def offloaded_keys(self) -> frozenset[int]:
        """Storage keys of the parts that are asleep."""
        ...


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8 [nbytes]`` tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or ``None`` (another C library, or no ``ctypes`` access)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def device_free_bytes(device: torch.device) -> int:
    """Bytes free on CUDA ``device`` for any process (``cudaMemGetInfo``)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def release_device_memory(device: torch.device) -> None:
    """Hand memory that the process freed on ``device`` back to whoever can use it.

    CUDA: empty the caching allocator (freed blocks would otherwise stay reserved
    by this process, unusable by another one on the same GPU). CPU: ask glibc to
    return free heap pages to the OS (``malloc_trim(0)``; large blocks are ``mmap``
    chunks that ``free`` already unmapped, smaller ones stay in the heap until
    trimmed). Nothing happens where neither applies.
    """
    if device.type == "cuda":
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
    elif device.type == "cpu":
        trim = _malloc_trim()
        if trim is not None:
            trim(0)


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
    host: torch.Tensor | None  # uint8 [nbytes] on the host; None: in the spill files


def _bytes_of(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU ``storage`` as a writable ``memoryview`` (no copy)."""
    n = storage.nbytes()
    return memoryview((ctypes.c_ubyte * n).from_address(storage.data_ptr())).cast("B")


def _new_spill_fd(label: str) -> int:
    """An anonymous in-memory file (``memfd``, Linux); where there is none (or a sandbox
    refuses it), an unlinked temporary file (page cache, written back to disk)."""
    if hasattr(os, "memfd_create"):
        try:
            return os.memfd_create(f"ppo_lifecycle:{label}", os.MFD_CLOEXEC)
        except OSError:  # pragma: no cover - seccomp or an old kernel
            pass
    with tempfile.TemporaryFile(prefix="ppo_lifecycle-") as handle:  # pragma: no cover
        return os.dup(handle.fileno())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


#: Storages are cut into pieces of at most this many bytes, spread over the files.
_SPILL_CHUNK = 32 * 2**20

#: At most this many buffers go to one ``pwritev``/``preadv`` (Linux's ``IOV_MAX``).
_IOV_MAX = 1024


def _transfer(
    call: Callable[[int, Sequence[memoryview], int], int],
    fd: int,
    views: Sequence[memoryview],
    offset: int,
) -> int:
    """Move ``views``, back to back from ``offset`` of ``fd``, through ``call``
    (``os.pwritev`` or ``os.preadv``): many buffers per system call (small tensors cost
    one call per batch, not one each), resuming after a short transfer. Returns the bytes
    moved; fewer than ``views`` hold only where ``call`` moved nothing (end of file)."""
    pending = list(views)
    first = moved = 0
    while first < len(pending):
        got = call(fd, pending[first : first + _IOV_MAX], offset + moved)
        if got <= 0:
            break
        moved += got
        while first < len(pending) and got >= len(pending[first]):
            got -= len(pending[first])
            first += 1
        if got:
            pending[first] = pending[first][got:]
    return moved


@dataclass(frozen=True)
class _Piece:
    item: int  # index into the part's saved storages
    start: int  # byte offset in the storage
    length: int
    file: int  # which of the part's files
    offset: int  # byte offset in that file


class _Spill:
    """One part's host copy, kept outside the process: anonymous in-memory files.

    On a CPU "device" a copy in the process's own memory cannot lower its resident
    set, so the bytes go to ``memfd`` files (kernel shared memory, not mapped, so not
    counted in the process's RSS) through ``pwritev``/``preadv`` (many pieces per
    call), spread over up to ``files`` files so that several threads copy at once
    (writes to one file are serialised by the kernel), and freed by as many threads
    at the wake-up. The files are closed with the backend; nothing is left behind,
    even when the process dies.
    """

    def __init__(self, label: str, files: int) -> None:
        self.label = label
        self.max_files = max(1, files)
        self.fds: list[int] = []
        self.pieces: list[_Piece] = []
        self._finalizer = weakref.finalize(self, _close_all, self.fds)

    def _layout(self, sizes: Sequence[int]) -> list[_Piece]:
        """Cut ``sizes`` into pieces over the files; each file's pieces, in list order,
        follow each other from its start (one run of bytes per file)."""
        total = sum(sizes)
        count = min(self.max_files, max(1, -(-total // _SPILL_CHUNK)))
        while len(self.fds) < count:
            self.fds.append(_new_spill_fd(f"{self.label}.{len(self.fds)}"))
        filled = [0] * count
        pieces: list[_Piece] = []
        for item, size in enumerate(sizes):
            for start in range(0, size, _SPILL_CHUNK):
                length = min(_SPILL_CHUNK, size - start)
                file = min(range(count), key=filled.__getitem__)
                pieces.append(_Piece(item, start, length, file, filled[file]))
                filled[file] += length
        for fd, size in zip(self.fds, filled + [0] * (len(self.fds) - count), strict=True):
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)  # a cached file longer than needed
        return pieces

    @staticmethod
    def _in_parallel(jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs`` at once, one thread each (none for a single job); the first
        failure is raised once every job has ended."""
        if len(jobs) <= 1:
            for job in jobs:
                job()
            return
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="ppo_lifecycle") as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()

    def _views(
        self, storages: Sequence[torch.UntypedStorage]
    ) -> dict[int, tuple[int, list[memoryview]]]:
        """Per file: where its pieces start in it and their bytes, in file order (a
        file's pieces follow each other, see :meth:`_layout`)."""
        whole = [_bytes_of(s) for s in storages]
        out: dict[int, tuple[int, list[memoryview]]] = {}
        for piece in self.pieces:
            _, views = out.setdefault(piece.file, (piece.offset, []))
            views.append(whole[piece.item][piece.start : piece.start + piece.length])
        return out

    def write(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """Copy every storage's bytes into the files (the storages are left as they are)."""
        self.pieces = self._layout([s.nbytes() for s in storages])
        by_file = self._views(storages)

        def job(file: int, offset: int, views: list[memoryview]) -> None:
            if _transfer(os.pwritev, self.fds[file], views, offset) < sum(map(len, views)):
                raise OSError(f"{self.label}: the host copy stopped growing (file {file})")

        try:
            self._in_parallel([functools.partial(job, f, *v) for f, v in by_file.items()])
        except BaseException:
            self.drop()
            raise

    def read(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """Copy the bytes back into ``storages`` (allocated, same sizes as written)."""
        by_file = self._views(storages)

        def job(file: int, offset: int, views: list[memoryview]) -> None:
            got = _transfer(os.preadv, self.fds[file], views, offset)
            if got < sum(map(len, views)):
                raise OSError(
                    f"{self.label}: host copy ends early ({offset + got} bytes in file {file})"
                )

        self._in_parallel([functools.partial(job, f, *v) for f, v in by_file.items()])

    def drop(self) -> None:
        """Free the files' memory (they stay open for the next sleep), one thread per
        file (the kernel frees them page by page: as much work as filling them)."""
        self._in_parallel([functools.partial(os.ftruncate, fd, 0) for fd in self.fds])
        self.pieces = []

    def nbytes(self) -> int:
        return sum(os.fstat(fd).st_size for fd in self.fds)

    def close(self) -> None:
        self._finalizer()


#: A piece of host memory: ``(address, bytes)``.
_Span = tuple[int, int]

#: Threads' shares of a copy into a host-memory process are rounded to this (2 MiB
#: transparent huge pages: no two threads fault in the same one).
_HUGE_PAGE = 2 * 2**20


def _split(spans: Sequence[_Span], count: int) -> list[tuple[list[_Span], int]]:
    """Cut ``spans`` (back to back from offset 0) into at most ``count`` runs of about
    equal bytes: ``(spans, offset of the run)`` each."""
    total = sum(n for _, n in spans)
    share = max(1, -(-total // max(1, count)))
    if share >= _HUGE_PAGE:
        share = -(-share // _HUGE_PAGE) * _HUGE_PAGE
    runs: list[tuple[list[_Span], int]] = []
    run: list[_Span] = []
    start = pos = 0
    for address, length in spans:
        while length > 0:
            take = min(length, start + share - pos)
            run.append((address, take))
            address, length, pos = address + take, length - take, pos + take
            if pos == start + share:
                runs.append((run, start))
                run, start = [], pos
    if run:
        runs.append((run, start))
    return runs


def _free_region(state: dict[str, Any]) -> None:
    """Hand a :class:`_ProcessSpill`'s region back to its host process (which it then
    stops holding: the process ends once nothing holds it)."""
    host: HostProcess | None = state.pop("host", None)
    address = state.pop("address", None)
    if host is not None and address is not None:
        with contextlib.suppress(OSError):
            host.free(address)


class _ProcessSpill:
    """One part's host copy, kept in a host-memory child process (see
    :mod:`ppo_lifecycle._host_process`): one region of the child's memory (2 MiB huge
    pages), written and read straight from and to the storages with
    ``process_vm_writev``/``readv`` by up to ``threads`` threads on disjoint runs, and
    unmapped by the child at the wake-up (this process does not wait for it).
    """

    def __init__(self, label: str, host: HostProcess, threads: int) -> None:
        self.label = label
        self.threads = max(1, threads)
        # What the finalizer frees: the host process and the region held in it.
        self._state: dict[str, Any] = {"host": host, "address": None, "nbytes": 0}
        self._finalizer = weakref.finalize(self, _free_region, self._state)

    @property
    def host(self) -> HostProcess:
        host: HostProcess = self._state["host"]
        return host

    def _runs(self, storages: Sequence[torch.UntypedStorage]) -> list[tuple[list[_Span], int]]:
        spans = [(s.data_ptr(), s.nbytes()) for s in storages]
        total = sum(n for _, n in spans)
        return _split(spans, min(self.threads, max(1, -(-total // _SPILL_CHUNK))))

    def write(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """Copy every storage's bytes into the host process (the storages are left as
        they are); a region of the right size from an earlier sleep is reused."""
        total = sum(s.nbytes() for s in storages)
        state = self._state
        if state["address"] is not None and state["nbytes"] != total:
            self.drop()
        if total == 0:
            return
        if state["address"] is None:
            if not self.host.alive:  # ended (killed?) while nothing was in it: a new one
                host, reason = shared_host_process()
                if host is None:
                    raise HostProcessError(f"{self.label}: {reason}")
                state["host"] = host
            state["address"], state["nbytes"] = self.host.alloc(total), total
        address = state["address"]

        def job(spans: list[_Span], offset: int) -> None:
            if self.host.write(spans, address + offset) < sum(n for _, n in spans):
                raise OSError(f"{self.label}: the host copy stopped growing at {offset}")

        try:
            _Spill._in_parallel([functools.partial(job, *run) for run in self._runs(storages)])
        except BaseException:
            self.drop()
            raise

    def read(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """Copy the bytes back into ``storages`` (allocated, same sizes as written)."""
        total = sum(s.nbytes() for s in storages)
        if total == 0:
            return
        address, held = self._state["address"], self._state["nbytes"]
        if address is None or held != total:
            raise OSError(f"{self.label}: the host copy holds {held} bytes, not {total}")
        self.host.check(address, total)  # alive, and still the process that holds it

        def job(spans: list[_Span], offset: int) -> None:
            got = self.host.read(spans, address + offset)
            if got < sum(n for _, n in spans):
                raise OSError(f"{self.label}: host copy ends early ({offset + got} bytes)")

        _Spill._in_parallel([functools.partial(job, *run) for run in self._runs(storages)])

    def drop(self) -> None:
        """Free the region (the host process unmaps it; this does not wait). Never
        raises: a host process that is gone holds nothing any more."""
        address = self._state["address"]
        self._state["address"], self._state["nbytes"] = None, 0
        if address is not None:
            with contextlib.suppress(OSError):
                self.host.free(address)

    def nbytes(self) -> int:
        nbytes: int = self._state["nbytes"]
        return nbytes

    def close(self) -> None:
        self._finalizer()


SpillTo = Literal["auto", "process", "memfd"]

_fallback_logged = False


def _log_fallback_once(reason: str) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning(
            "host copies of CPU storages go to memfd files (slower sleeps and wake-ups): %s",
            reason,
        )


class HostCopyBackend:
    """Copy each storage to host memory, free it on the device, restore it in place.

    The device storage object is kept and resized (``resize_(0)`` on sleep, back to
    its size on wake-up), so every tensor, view, optimizer entry and autograd node
    that refers to it stays valid. After the storages are released the memory goes
    back where another process can use it: on CUDA the caching allocator is emptied
    (``torch.cuda.empty_cache()``); on a CPU "device" free heap pages are returned to
    the OS (``malloc_trim``) after each part (parameters, gradients, optimizer state,
    buffers) that freed at least :attr:`CPU_TRIM_MIN_BYTES`.
    A trim returns every free heap page of the process, the activations its next
    forward and backward reuse included, and that pass then faults all of them in
    again: for a model of a few MiB the trim gives back next to nothing of the model and
    costs the next pass more than the sleep itself (on the built-in task, 2 cores: 8 %
    of a step). Below the threshold the freed storages stay in the process's heap for
    its own reuse (large storages are ``mmap`` chunks, which ``free`` returns at once
    either way). On CUDA the host copies are pinned and the copies run asynchronously
    with one synchronisation per direction.

    On a CPU "device" the host copy cannot stay in the process (its resident memory
    *is* the device memory): by default it is spilled out of the process, so a
    sleeping CPU worker's RSS drops by what it put to sleep. Where it can, the copy
    goes to a small child process that holds memory for this one (started at the
    first sleep, shared by the process's backends, ended and reaped once none holds
    it; 2 MiB huge pages, copied to and fro with ``process_vm_writev``/``readv``: see
    :mod:`ppo_lifecycle._host_process`). Where that is not allowed (Yama
    ``ptrace_scope`` >= 2, a seccomp profile without ``process_vm_writev``) it goes
    to anonymous in-memory files instead (``memfd``: kernel shared memory outside the
    process's resident set, never on disk; 4 KiB pages, so slower), logged once.
    Either way the copy is freed when the backend goes away, or the process dies.

    Args:
        device: the device whose storages move (``cpu`` or ``cuda:N``).
        pin_memory: pin host copies; default: ``True`` on CUDA.
        cache_host_buffers: keep the host copies' memory while awake, so later sleeps
            reuse it (pinning and first-touch page faults are slow). Default: ``True``
            on CUDA (pinned buffers); ``False`` with a spill (on a CPU "device" the
            host is the device: cached copies would hold the model's memory twice).
        spill: host copies go outside the process (CPU only); default: ``True`` on a
            CPU "device". ``False``: ``torch`` host tensors.
        spill_to: where a spill goes: ``"process"`` (a host-memory child process;
            raises at the first sleep where that cannot work), ``"memfd"`` (in-memory
            files), ``"auto"`` (default: the process, else memfd files).
        spill_files: how many copying threads (and memfd files) a part is spread
            over; default: ``torch.get_num_threads()``, at most 8.

    Raises:
        ValueError: ``spill=True`` on a device that is not the CPU, or an unknown
            ``spill_to``.
    """

    name = "host_copy"

    #: A part put to sleep on a CPU "device" that freed less than this does not trim.
    CPU_TRIM_MIN_BYTES = 16 * 2**20

    def __init__(
        self,
        device: torch.device,
        *,
        pin_memory: bool | None = None,
        cache_host_buffers: bool | None = None,
        spill: bool | None = None,
        spill_to: SpillTo = "auto",
        spill_files: int | None = None,
    ) -> None:
        self.device = device
        on_cuda = device.type == "cuda"
        self.spill = device.type == "cpu" if spill is None else spill
        if self.spill and device.type != "cpu":
            raise ValueError(
                f"spill=True: device {device} is not the CPU; a spill keeps a CPU device's "
                "host copy outside the process (on CUDA the host copy is pinned memory)"
            )
        if spill_to not in ("auto", "process", "memfd"):
            raise ValueError(f"spill_to: {spill_to!r} is not 'auto', 'process' or 'memfd'")
        self.spill_to: SpillTo = spill_to
        self.pin_memory = on_cuda if pin_memory is None else pin_memory
        if cache_host_buffers is None:
            cache_host_buffers = not self.spill
        self.cache_host_buffers = cache_host_buffers
        if spill_files is not None and spill_files < 1:
            raise ValueError(f"spill_files: {spill_files} is not >= 1")
        self.spill_files = spill_files or min(8, torch.get_num_threads())
        self._saved: dict[Part, list[_Saved]] = {}
        self._cache: dict[int, torch.Tensor] = {}
        self._cache_keys: dict[Part, set[int]] = {}  # the cached buffers' storages, per part
        self._spills: dict[Part, _Spill | _ProcessSpill] = {}

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        cached = self._cache.get(key)
        if cached is not None and cached.numel() == nbytes:
            return cached
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
        if self.cache_host_buffers:
            self._cache[key] = buf
        return buf

    def _spill_of(self, part: Part) -> _Spill | _ProcessSpill:
        spill = self._spills.get(part)
        if spill is None:
            host = None
            if self.spill_to != "memfd":
                host, reason = shared_host_process()
                if host is None:
                    if self.spill_to == "process":
                        raise HostProcessError(f"spill_to='process': {reason}")
                    _log_fallback_once(reason)
            if host is not None:
                spill = _ProcessSpill(f"{part.value}", host, self.spill_files)
            else:
                spill = _Spill(f"{part.value}", self.spill_files)
            self._spills[part] = spill
        return spill

    @property
    def spill_kind(self) -> Literal["process", "memfd"] | None:
        """Where this backend's host copies went (``None``: no spill made yet)."""
        if not self._spills:
            return None
        first = next(iter(self._spills.values()))
        return "process" if isinstance(first, _ProcessSpill) else "memfd"

    def check_releasable(self, part: Part, groups: Sequence[StorageGroup]) -> None:
        """Raise ValueError, before anything moves, if a storage cannot be freed.

        A storage that cannot be resized (a tensor wrapping a file or a foreign buffer)
        could be copied out but never released, and ``resize_`` would fail half-way.
        """
        fixed = [g for g in groups if not g.storage.resizable()]
        if fixed:
            raise ValueError(
                f"cannot put {part.value} to sleep: {len(fixed)} storage(s) of "
                f"{sum(g.nbytes for g in fixed)} bytes are not resizable (tensors that wrap a "
                "file or an external buffer, e.g. straight from safetensors.load_file or "
                "torch.frombuffer); nothing was moved. Give them storage of their own first "
                "(tensor.clone()) when loading state into the model or optimizer"
            )

    def offload(self, part: Part, groups: Sequence[StorageGroup]) -> int:
        """Copy ``part``'s storages to the host, then release them (a sleep)."""
        assert part not in self._saved, f"{part} put to sleep twice"
        self.check_releasable(part, groups)
        saved: list[_Saved] = []
        if self.spill:
            self._spill_of(part).write([g.storage for g in groups])
            saved = [_Saved(g.key, g.storage, g.nbytes, None) for g in groups]
        else:
            if self.cache_host_buffers:  # a storage replaced since (set_to_none, a state
                live = {g.key for g in groups}  # load) leaves its buffer behind: drop it
                for gone in self._cache_keys.get(part, set()) - live:
                    self._cache.pop(gone, None)
                self._cache_keys[part] = live
            # the copies run on the current stream: what another stream still writes
            # (an unwaited collective, a side stream) must land first
            _synchronize(self.device)
            for group in groups:
                storage, key, nbytes = group.storage, group.key, group.nbytes
                host = self._host_buffer(key, nbytes)
                host.untyped_storage().copy_(storage, non_blocking=self.pin_memory)
                saved.append(_Saved(key, storage, nbytes, host))
            _synchronize(self.device)
        # Only after every copy landed: free the device memory, and hand it back.
        for item in saved:
            item.storage.resize_(0)
        freed = sum(item.nbytes for item in saved)
        if self.device.type != "cpu" or freed >= self.CPU_TRIM_MIN_BYTES:
            release_device_memory(self.device)
        self._saved[part] = saved
        return freed

    def reload(self, part: Part) -> int:
        """Reallocate ``part``'s storages in place and copy their bytes back (a wake-up)."""
        assert part in self._saved, f"{part} woken up without being put to sleep"
        pending = self._saved[part]
        for item in pending:
            # A retry after a failed wake-up skips storages already allocated.
            if item.storage.nbytes() != item.nbytes:
                item.storage.resize_(item.nbytes)
        if self.spill:
            spill = self._spills[part]
            spill.read([item.storage for item in pending])
            if not self.cache_host_buffers:
                spill.drop()
        else:
            for item in pending:
                assert item.host is not None
                item.storage.copy_(item.host.untyped_storage(), non_blocking=self.pin_memory)
            _synchronize(self.device)
        del self._saved[part]
        return sum(item.nbytes for item in pending)

    def offloaded_keys(self) -> frozenset[int]:
        return frozenset(item.key for items in self._saved.values() for item in items)

    def host_bytes(self) -> int:
        """Host memory held (copies of sleeping parts plus cached buffers or files)."""
        keys = {
            id(item.host): item.nbytes
            for v in self._saved.values()
            for item in v
            if item.host is not None
        }
        keys.update({id(buf): buf.numel() for buf in self._cache.values()})
        return sum(keys.values()) + sum(s.nbytes() for s in self._spills.values())


HookMode = Literal["preload", "torch"]

# torch_memory_saver 0.0.10 finds its preload hook as the one LD_PRELOAD entry whose
# path contains this (torch_memory_saver/hooks/mode_preload.py, get_path_binary).
_PRELOAD_MARK = "torch_memory_saver"


def _preloaded_hooks() -> list[str]:
    """The ``LD_PRELOAD`` entries that ``torch_memory_saver`` takes for its hook."""
    return [p for p in os.environ.get("LD_PRELOAD", "").split(":") if _PRELOAD_MARK in p]


# id(singleton) -> (the singleton, the hook mode this module set on it; it applies at
# first use). The entry holds the singleton, so its id is never reused by another object.
_set_hook_modes: dict[int, tuple[Any, HookMode]] = {}


def _resolve_hook_mode(tms: Any, requested: HookMode | None) -> HookMode:
    """Configure the singleton's hook mode (if still possible); return the mode in force.

    ``TorchMemorySaver.hook_mode`` is a write-only property that only works before
    the singleton's first use (``region``/``pause``/``resume`` build its implementation
    with the mode; later the setter fails). There is no environment variable for it.
    """
    impl = getattr(tms, "_impl", None)  # no public getter: reading hook_mode raises
    if impl is not None:  # already in use (this process made a region or paused before)
        active: HookMode | None = getattr(impl, "_hook_mode", None)
    else:  # set by an earlier backend, applied at the singleton's first use
        entry = _set_hook_modes.get(id(tms))
        active = entry[1] if entry is not None else None
    if active is not None and requested is not None and active != requested:
        raise ValueError(
            f"hook_mode={requested!r}: torch_memory_saver in this process already has "
            f"hook_mode={active!r} (in use, or set by an earlier backend); the mode is "
            "fixed at its first use: give every backend the same one"
        )
    if impl is not None or active is not None:
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
    _set_hook_modes[id(tms)] = (tms, mode)
    return mode


# ids of the singletons given the exit hook (the hook keeps its singleton alive, so an
# id here is never reused by another object)
_exit_hooked: set[int] = set()


def _tms_library(tms: Any) -> Any | None:
    """The singleton's loaded C library (built at its first use), or None where this
    torch_memory_saver keeps it elsewhere."""
    impl = getattr(tms, "_impl", None)
    return getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)


def _accept_pool_frees_at_exit(tms: Any) -> None:
    """Once per singleton: at interpreter exit, mark the exiting thread as inside a
    region, so the ``torch`` hook mode's free (called when the regions' memory pools
    are destroyed, after ``atexit``) does not end the process with status 1."""
    if id(tms) in _exit_hooked:
        return
    _exit_hooked.add(id(tms))

    def accept() -> None:
        library = _tms_library(tms)
        if library is not None and hasattr(library, "tms_set_interesting_region"):
            library.tms_set_interesting_region(True)

    atexit.register(accept)


def _retain_cpu_backups(tms: Any) -> bool:
    """Turn on the library's retention of pinned CPU backups across resumes (process
    wide); False where this torch_memory_saver has no such setting, and on ROCm, where
    the setting exists but the library ends the process when it is turned on
    (0.0.10: "retained CPU backup policy is CUDA-only")."""
    if getattr(torch.version, "hip", None):
        return False
    if not isinstance(getattr(type(tms), "retain_cpu_backup", None), property):
        return False
    tms.retain_cpu_backup = True
    return True


def _expandable_segments_on() -> bool:
    return any(
        "expandable_segments:True" in os.environ.get(var, "")
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )


def _device_segments(device: torch.device) -> list[dict[str, Any]]:
    """The caching allocator's segments on ``device`` (``torch.cuda.memory_snapshot``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments: list[dict[str, Any]] = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    return [s for s in segments if s.get("device", index) == index]


def _private_segments(device: torch.device) -> list[tuple[int, int, tuple[int, ...]]] | None:
    """``(start, end, pool)`` of ``device``'s caching-allocator segments owned by a
    private pool (not the default pool ``(0, 0)``); ``None`` when this torch does not
    report segment pools."""
    out: list[tuple[int, int, tuple[int, ...]]] = []
    for segment in _device_segments(device):
        pool = segment.get("segment_pool_id")
        if pool is None:
            return None
        if tuple(pool) != (0, 0):
            start = int(segment["address"])
            out.append((start, start + int(segment["total_size"]), tuple(pool)))
    return out


def _private_pool_ranges(device: torch.device) -> list[tuple[int, int]] | None:
    """Address ranges of ``device``'s caching-allocator segments owned by a private pool.

    ``torch_memory_saver`` regions are ``MemPool``s, so a storage allocated inside
    one lies in such a segment; one allocated in the default pool (``(0, 0)``) was
    not. ``None`` when this torch does not report segment pools.
    """
    segments = _private_segments(device)
    return None if segments is None else [(lo, hi) for lo, hi, _ in segments]


def _pool_segment_bytes(device: torch.device, pointers: Iterable[int]) -> int:
    """Bytes of ``device``'s segments in the private pools that hold any of ``pointers``:
    what ``torch_memory_saver`` maps back when it resumes their region (it pauses and
    resumes the pool's whole segments, each one allocation of the caching allocator,
    used or not; small storages share 2 MiB segments and 1-10 MiB ones 20 MiB ones).
    0 when this torch does not report segment pools."""
    segments = _private_segments(device) or []
    addresses = sorted(pointers)
    pools = set()
    for lo, hi, pool in segments:
        first = bisect.bisect_left(addresses, lo)  # the first pointer at or above lo
        if first < len(addresses) and addresses[first] < hi:
            pools.add(pool)
    return sum(hi - lo for lo, hi, pool in segments if pool in pools)


class TorchMemorySaverBackend:
    """CUDA only: pause/resume ``torch_memory_saver`` regions, one tag per part.

    Storages are (re)allocated inside ``region(tag=f"{name}/{part}",
    enable_cpu_backup=...)``. A trainer can allocate directly in the right region
    with :meth:`region` (no copy at the first sleep); anything found outside is
    moved into its part's region once, at the first sleep that offloads it (the
    tensor objects are kept: ``Tensor.set_`` onto the new storage). Each old block
    is dropped as soon as its copy is made, and the caching allocator is emptied
    every ``RELEASE_EVERY_BYTES`` moved and at the end: the move needs the model
    plus about that much, and another process can use the old blocks right after.
    Storages are recognised by identity and address: one freed and replaced (an
    optimizer's ``load_state_dict``, ``zero_grad(set_to_none=True)``) is moved in
    again at the next sleep.

    ``torch_memory_saver`` ends the process (``exit(1)``, no exception) when the
    device is out of memory for a region allocation (``torch`` hook mode) or for a
    ``resume``. So before moving a storage into a region and before a wake-up, the
    free device memory is checked against the bytes needed (after emptying this
    process's cache) and a shortfall raises ``RuntimeError`` instead: the part
    stays as it was and the call can be retried once the other process has slept.
    A move counts the storage's bytes plus ``HEADROOM_BYTES`` (one allocator
    segment); a wake-up counts what the library will map back (:meth:`resume_bytes`:
    the region's whole allocator segments, at least the storages' bytes), plus
    ``HEADROOM_BYTES``.

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

    In ``torch`` hook mode the library also ends the process (``exit(1)``) when its
    allocator frees a block outside a region, which is what the regions' memory pools
    do when they are destroyed at interpreter exit: every process that used a region
    exited with status 1 (seen on an H200, torch 2.11, torch_memory_saver 0.0.10; its
    own tests ignore the status). The first backend of a process therefore registers
    an ``atexit`` hook that marks the exiting thread as inside a region, so those
    frees go through and the process exits with its own status.

    The host copies (``cpu_backup_parts``) are the library's pinned CPU backups, which
    it allocates at each pause and frees at each resume unless it retains them
    (``retain_cpu_backup``): pinning 3 GiB took 1.8 s per sleep on the H200, 30 times
    a pinned copy. ``retain_host_copies`` (default) turns retention on for the
    process, like ``HostCopyBackend``'s ``cache_host_buffers``: the host keeps the
    paused bytes' worth of pinned memory while the model is awake.

    Args:
        device: a CUDA device.
        name: prefix of the tags (one manager per model: ``actor``, ``critic``).
        cpu_backup_parts: parts whose contents must survive a pause (default: all).
        hook_mode: ``torch_memory_saver`` hook mode, fixed at the first use of its
            process-wide singleton; default ``preload`` when the process was started
            with its ``LD_PRELOAD`` hook, else ``torch``. Ignored (the mode in force
            is kept) when it was already in use, unless it contradicts an explicit one.
        retain_host_copies: keep the pinned CPU backups across wake-ups (the
            library's ``retain_cpu_backup``, process-wide: turned on by any backend
            that asks for it, never turned off). Ignored by a torch_memory_saver
            without it.

    Raises:
        ValueError: not CUDA, the extra is missing, ``name`` is taken by a live
            backend, expandable segments are on, or the hook mode cannot be had.
    """

    name = "torch_memory_saver"
    RELEASE_EVERY_BYTES: ClassVar[int] = 256 << 20
    HEADROOM_BYTES: ClassVar[int] = 20 << 20  # torch's segment for 1-10 MiB blocks
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
        retain_host_copies: bool = True,
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
        if self.hook_mode == "torch":
            _accept_pool_frees_at_exit(self._tms)
        self.retain_host_copies = retain_host_copies and _retain_cpu_backups(self._tms)
        self.device = device
        self.prefix = name
        self.cpu_backup_parts = cpu_backup_parts
        # storages known to be in a part's region: key -> address (a freed storage's key
        # can be reused by a new one, in the default pool: its address tells them apart)
        self._adopted: dict[Part, dict[int, int]] = {part: {} for part in Part}
        # adopted on the caller's word, not yet checked against the allocator's pools
        # (once checked, a storage keeps its address: later sleeps skip the snapshot)
        self._unchecked: dict[Part, set[int]] = {part: set() for part in Part}
        self._paused: dict[Part, list[tuple[int, int]]] = {}
        self._live[name] = self

    def tag(self, part: Part) -> str:
        return f"{self.prefix}/{part.value}"

    @contextlib.contextmanager
    def region(self, part: Part) -> Iterator[None]:
        """Allocate inside ``part``'s pausable region (this thread's allocations only).
        Refused while ``part`` sleeps: the library would hand out a block of the paused
        (unmapped) pool, or make an allocation its next ``resume`` refuses by ending
        the process."""
        if part in self._paused:
            raise RuntimeError(
                f"{self.tag(part)} is asleep: wake it up (reload) before allocating in its region"
            )
        with (
            torch.cuda.device(self.device),
            self._tms.region(tag=self.tag(part), enable_cpu_backup=part in self.cpu_backup_parts),
        ):
            yield

    def adopt(self, part: Part, keys: set[int]) -> None:
        """Record storage keys allocated inside ``part``'s region (checked at the first
        sleep that finds them)."""
        self._unchecked[part].update(keys)

    def adopt_tensors(self, part: Part, tensors: Iterable[torch.Tensor]) -> None:
        """Record that ``tensors`` were allocated inside ``part``'s :meth:`region`."""
        self.adopt(part, {t.untyped_storage()._cdata for t in tensors})

    def _outside_regions(self, part: Part, groups: Sequence[StorageGroup]) -> set[int]:
        """Check the adopted, not yet checked storages in ``groups``: those in a private
        pool are recorded as in the region (by address); returns the keys of the others."""
        unchecked = [g for g in groups if g.key in self._unchecked[part] and g.nbytes > 0]
        if not unchecked:
            return set()
        self._unchecked[part] -= {g.key for g in unchecked}
        ranges = _private_pool_ranges(self.device)
        stray: set[int] = set()
        for group in unchecked:
            ptr = group.storage.data_ptr()
            if ranges is None or any(lo <= ptr < hi for lo, hi in ranges):
                self._adopted[part][group.key] = ptr
            else:
                stray.add(group.key)
        return stray

    def _in_region(self, part: Part, group: StorageGroup) -> bool:
        """Whether ``group``'s storage is one recorded in ``part``'s region (same key
        and address; a recorded key at another address is a new storage)."""
        ptr = self._adopted[part].get(group.key)
        if ptr is None:
            return False
        if ptr == group.storage.data_ptr():
            return True
        del self._adopted[part][group.key]  # that storage was freed; its key was reused
        return False

    def _require_free(self, nbytes: int, what: str) -> None:
        """Raise instead of letting ``torch_memory_saver`` end the process when the
        device cannot hold ``nbytes`` more (this process's cache emptied first)."""
        nbytes += self.HEADROOM_BYTES
        free = device_free_bytes(self.device)
        if free >= nbytes:
            return
        release_device_memory(self.device)
        free = device_free_bytes(self.device)
        if free < nbytes:
            raise RuntimeError(
                f"{self.prefix}: {what} needs {nbytes} bytes on {self.device} and "
                f"{free} are free (another process still holds them?); nothing was "
                "moved: put the other model to sleep first, then retry (torch_memory_saver "
                "would end the process on this out-of-memory)"
            )

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
        released: list[tuple[int, int]] = []
        moved = 0
        for group in groups:
            if self._in_region(part, group):
                released.append((group.key, group.nbytes))
                continue
            self._require_free(group.nbytes, f"moving a {part.value} storage into its region")
            with self.region(part):
                fresh = torch.empty(group.nbytes, dtype=torch.uint8, device=self.device)
            # the group drops the old storage: no reference is left, its block is freed
            group.storage = rehome(group, fresh.untyped_storage())
            self._adopted[part][group.key] = group.storage.data_ptr()
            released.append((group.key, group.nbytes))
            moved += group.nbytes
            if moved >= self.RELEASE_EVERY_BYTES:  # the old blocks, to the device
                release_device_memory(self.device)
                moved = 0
        torch.cuda.synchronize(self.device)
        self._tms.pause(tag)
        self._paused_tags.add(tag)
        self._paused[part] = released
        # The pause gave the region's memory back to the device; the old blocks of the
        # storages moved into the region just now are freed blocks of the caching
        # allocator until it is emptied.
        release_device_memory(self.device)
        return sum(n for _, n in released)

    def reload(self, part: Part) -> int:
        assert part in self._paused, f"{part} resumed without being paused"
        tag = self.tag(part)
        nbytes = sum(n for _, n in self._paused[part])
        self._require_free(self.resume_bytes(part), f"waking {part.value}")
        self._tms.resume(tag)
        self._paused_tags.discard(tag)
        torch.cuda.synchronize(self.device)
        del self._paused[part]
        return nbytes

    def resume_bytes(self, part: Part) -> int:
        """Device bytes the library maps back when sleeping ``part`` resumes: its
        region's whole allocator segments (a paused pool gains none: :meth:`region`
        refuses while it sleeps), at least its storages' bytes."""
        paused = self._paused[part]
        addresses = (self._adopted[part][key] for key, _ in paused)
        return max(_pool_segment_bytes(self.device, addresses), sum(n for _, n in paused))

    def offloaded_keys(self) -> frozenset[int]:
        return frozenset(key for items in self._paused.values() for key, _ in items)
