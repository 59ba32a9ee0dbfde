"""Where a sleeping model's memory goes: the offload backend a device gets, and the NCCL
communicators a sleeping process releases.

Offload backend (``config.offload_backend``): :func:`resolve_offload_backend` turns
``auto`` into ``memory_saver`` (``torch_memory_saver`` regions, paused on sleep) on CUDA
when that package is installed and the backend supports it, ``host_copy`` otherwise; an
explicit ``memory_saver`` that cannot run is refused with the fix. The backends call it
on the worker's device; the driver's ``validate`` calls it before anything starts.

Communicators (``release_process_groups`` / ``restore_process_groups`` of a backend): a
``ProcessGroupNCCL`` keeps device buffers per communicator (channels, proxies, work
FIFOs: hundreds of MiB per group at scale). Since NCCL 2.29.7 ``ncclCommSuspend(comm,
NCCL_SUSPEND_MEM)`` releases them and ``ncclCommResume`` brings them back, communicator
and peers unchanged; torch exposes both as ``ProcessGroupNCCL.suspend()`` /
``resume()`` (with ``memory_stats()``), which is what :class:`CommunicatorSuspender`
calls. Destroying and re-creating the groups instead (what slime/miles do, by wrapping
every ``new_group``) would hand new group objects to code that keeps the old ones
(megatron's DDP buffers, Transformer Engine's layers); suspend/resume keeps them valid.
Both calls are collective over each communicator: every rank of a worker group sleeps
and wakes together (the driver calls all ranks), and every rank walks its groups in
creation order, which megatron keeps the same on every rank.

Gloo (the CPU backend) holds no device memory, only sockets and small host buffers:
nothing is released there. A process may hold an actor and a critic on the same
groups (tests, one-process set-ups): the communicators are suspended only while every
model registered in the process is asleep, and resumed when the first wakes.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from ppo_trainer._config import offload_backend_name

__all__ = [
    "CommunicatorSuspender",
    "SuspendableComm",
    "lifecycle_backend_name",
    "memory_saver_installed",
    "memory_saver_problem",
    "nccl_communicators",
    "process_groups",
    "resolve_offload_backend",
]

log = logging.getLogger(__name__)

OffloadChoice = Literal["host_copy", "memory_saver", "none"]

# The trainer's spelling (OFFLOAD_BACKENDS) -> ppo_lifecycle.OffloadManager's name
# (``none``: the workers never ask their manager to move anything; it holds a host-copy
# backend that stays unused).
_LIFECYCLE_NAMES = {
    "auto": "auto",
    "host_copy": "host_copy",
    "memory_saver": "torch_memory_saver",
    "none": "host_copy",
}
# Backends whose models can live in memory-saver regions (megatron-core allocates its
# DDP buffers itself, outside any region: a pause would not free them).
_MEMORY_SAVER_BACKENDS = ("torch",)


def memory_saver_installed() -> bool:
    """Whether ``torch_memory_saver`` (``ppo-lifecycle[cuda]``) is importable here."""
    return importlib.util.find_spec("torch_memory_saver") is not None


def lifecycle_backend_name(choice: str) -> str:
    """``ppo_lifecycle.OffloadManager``'s ``backend`` for a trainer spelling
    (``memory_saver`` -> ``torch_memory_saver``; the others unchanged)."""
    return _LIFECYCLE_NAMES.get(choice, choice)


def memory_saver_problem(
    *, device: torch.device | str, backend: str = "torch", key: str = "offload_backend"
) -> tuple[str, str] | None:
    """Why ``offload_backend='memory_saver'`` cannot run for ``backend`` on ``device``, as
    ``(what is wrong, the fix)``; None when it can (the rule
    :func:`resolve_offload_backend` applies, asked by the driver's validate too)."""
    fallback = f"set {key}='host_copy' (or 'auto', which picks host_copy there)"
    if backend not in _MEMORY_SAVER_BACKENDS:
        return (
            f"is not supported by the {backend} backend (megatron-core allocates its DDP "
            "buffers outside a memory-saver region, so a pause would not free them)",
            fallback,
        )
    if torch.device(device).type != "cuda":
        return (
            f"needs CUDA (torch_memory_saver pauses CUDA memory; the device here is "
            f"{torch.device(device)})",
            fallback,
        )
    if not memory_saver_installed():
        return (
            "needs the torch_memory_saver package, which is not installed",
            "install the extra (`uv sync --extra cuda`, or `pip install 'ppo-lifecycle[cuda]'`), "
            f"or {fallback}",
        )
    return None


def resolve_offload_backend(
    requested: str,
    *,
    device: torch.device | str,
    backend: str = "torch",
    key: str = "offload_backend",
) -> OffloadChoice:
    """The offload backend a model on ``device`` gets for ``requested``.

    ``host_copy`` and ``none`` (offload off, for debugging) stay. ``auto`` is
    ``memory_saver`` on CUDA when ``torch_memory_saver`` is installed and ``backend``
    supports it (the torch backend; not megatron), else ``host_copy``. ``memory_saver`` is
    returned when it can run; otherwise ``ValueError`` names ``key``, why, and the fix
    (``ppo_lifecycle``'s ``torch_memory_saver`` is read as ``memory_saver``).
    """
    dev = torch.device(device)
    choice = offload_backend_name(requested)
    if choice == "host_copy":
        return "host_copy"
    if choice == "none":
        return "none"
    supported = backend in _MEMORY_SAVER_BACKENDS
    if choice == "auto":
        if supported and dev.type == "cuda" and memory_saver_installed():
            return "memory_saver"
        return "host_copy"
    if choice != "memory_saver":
        raise ValueError(
            f"{key}={requested!r} is invalid: use 'auto', 'host_copy', 'memory_saver' or 'none'"
        )
    problem = memory_saver_problem(device=dev, backend=backend, key=key)
    if problem is not None:
        raise ValueError(f"{key}='memory_saver' {problem[0]}; {problem[1]}")
    return "memory_saver"


# --------------------------------------------------------------------------- communicators


class SuspendableComm(Protocol):
    """What :class:`CommunicatorSuspender` needs of a communicator (a torch
    ``ProcessGroupNCCL`` backend object)."""

    def suspend(self) -> None: ...

    def resume(self) -> None: ...


def _has_communicator(backend: Any) -> bool:
    """Whether a ``ProcessGroupNCCL`` has created its communicator (NCCL groups connect
    lazily, at their first collective: one never used holds nothing)."""
    try:
        return int(backend._comm_ptr()) != 0
    except (RuntimeError, ValueError, AttributeError):
        return False


def process_groups() -> list[Any]:
    """Every process group this process belongs to (the default one included), in
    creation order (``torch.distributed``'s own registry); empty before
    ``init_process_group``."""
    if not dist.is_available() or not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map)


_UNSUPPORTED_NCCL: set[str] = set()  # the NCCL backend classes already warned about


def _nccl_backend(backend: Any) -> Any | None:
    """The ``ProcessGroupNCCL`` a group's CUDA backend is, or runs under the wrapper
    that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts around it (``_ProcessGroupWrapper``,
    whose checks go through a gloo group of their own); ``None`` for any other backend.
    A ``ProcessGroupNCCL`` without ``suspend()`` (torch < 2.12) is returned too: the
    suspender refuses it, with a warning. Another NCCL backend class (torch's
    ``ProcessGroupNCCL2`` under ``TORCH_DIST_USE_NCCL2=1``) exposes no communicator to
    check: it is left out, with a warning once per class, instead of silently."""
    name = type(backend).__name__
    if name == "_ProcessGroupWrapper":
        backend = getattr(backend, "wrapped_pg", None)
        name = type(backend).__name__
    if name == "ProcessGroupNCCL":
        return backend
    if name.startswith("ProcessGroupNCCL") and name not in _UNSUPPORTED_NCCL:
        _UNSUPPORTED_NCCL.add(name)
        log.warning(
            "NCCL communicators of torch's %s stay on the device while the models sleep "
            "(only its ProcessGroupNCCL can be suspended; TORCH_DIST_USE_NCCL2=1 selects "
            "ProcessGroupNCCL2)",
            name,
        )
    return None


def nccl_communicators(groups: Iterable[Any]) -> list[SuspendableComm]:
    """The NCCL backends of ``groups`` (``ProcessGroup`` objects) that hold a
    communicator and can be suspended, in the given order, each once (under a debug
    wrapper: the NCCL backend it wraps). Gloo groups (and groups without a CUDA
    backend) are left out: they hold no device memory."""
    if not torch.cuda.is_available():
        return []
    out: list[SuspendableComm] = []
    seen: set[int] = set()
    cuda = torch.device("cuda")
    for group in groups:
        try:
            backend = group._get_backend(cuda)
        except (RuntimeError, ValueError, AttributeError):
            continue
        backend = _nccl_backend(backend)
        if backend is None:
            continue
        if id(backend) in seen or not _has_communicator(backend):
            continue
        seen.add(id(backend))
        out.append(backend)
    return out


class _Registry:
    """Process-wide: the registered models (weakly: one that is gone no longer counts),
    which of them are awake, and what is suspended."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.members: weakref.WeakValueDictionary[int, CommunicatorSuspender] = (
            weakref.WeakValueDictionary()
        )
        self.awake: set[int] = set()
        self.suspended: list[SuspendableComm] = []
        self.unsupported: str | None = None  # why suspend failed once (then never retried)
        self.ids = itertools.count()

    def anyone_awake(self) -> bool:
        self.awake &= set(self.members.keys())
        return bool(self.awake)


_REGISTRY = _Registry()


class CommunicatorSuspender:
    """Releases the device memory of a model's NCCL communicators while it sleeps.

    One per backend instance (per model's worker). ``communicators`` lists the
    suspendable communicators the model uses (:func:`nccl_communicators` of its
    groups), evaluated at each release. :meth:`release` marks the model asleep and,
    once every model registered in this process is asleep, suspends the union of their
    communicators (``ncclCommSuspend``); :meth:`restore` resumes them (before the model
    uses them) and marks it awake. Both are idempotent. If suspending is refused (NCCL
    older than 2.29.7), what was suspended is resumed, a warning names the reason, and
    later releases keep the communicators (the process's choice is fixed: a collective
    call must not succeed on some ranks and be skipped on others).
    """

    def __init__(
        self, communicators: Callable[[], Sequence[SuspendableComm]], *, name: str
    ) -> None:
        self.name = name
        self._communicators = communicators
        self._registry = _REGISTRY
        with self._registry.lock:
            self._key = next(self._registry.ids)
            self._registry.members[self._key] = self
            self._registry.awake.add(self._key)

    @property
    def suspended(self) -> int:
        """How many communicators of this process are suspended now."""
        return len(self._registry.suspended)

    def release(self) -> int:
        """This model sleeps; returns how many communicators were suspended by this call."""
        reg = self._registry
        with reg.lock:
            reg.awake.discard(self._key)
            if reg.anyone_awake() or reg.suspended or reg.unsupported:
                return 0
            comms: list[SuspendableComm] = []
            seen: set[int] = set()
            for _, member in sorted(reg.members.items()):  # registration order
                for comm in member._communicators():
                    if id(comm) not in seen:
                        seen.add(id(comm))
                        comms.append(comm)
            done: list[SuspendableComm] = []
            try:
                for comm in comms:
                    comm.suspend()
                    done.append(comm)
            except (RuntimeError, AttributeError) as exc:  # old NCCL; torch without suspend()
                for comm in reversed(done):
                    comm.resume()
                reason = " ".join(str(exc).split())[:300]
                if isinstance(exc, AttributeError):
                    reason = f"torch {torch.__version__}: {reason}"
                reg.unsupported = reason
                log.warning(
                    "%s: NCCL communicators stay on the device while asleep (suspend refused: "
                    "%s; it needs NCCL >= 2.29.7 and torch's ProcessGroupNCCL.suspend)",
                    self.name,
                    reg.unsupported,
                )
                return 0
            reg.suspended = done
            if done:
                log.info("%s: suspended %d NCCL communicator(s)", self.name, len(done))
            return len(done)

    def restore(self) -> int:
        """This model wakes; returns how many communicators were resumed by this call."""
        reg = self._registry
        with reg.lock:
            resumed = 0
            while reg.suspended:  # a resume that raises leaves the rest for a retry
                reg.suspended[0].resume()
                reg.suspended.pop(0)
                resumed += 1
            reg.awake.add(self._key)
            if resumed:
                log.info("%s: resumed %d NCCL communicator(s)", self.name, resumed)
            return resumed
