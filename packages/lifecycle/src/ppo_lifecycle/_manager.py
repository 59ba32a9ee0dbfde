"""The reusable sleep/wake_up mechanism trainer workers embed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ._backends import (
    BackendName,
    HookMode,
    HostCopyBackend,
    OffloadBackend,
    TorchMemorySaverBackend,
)
from ._parts import ALL_PARTS, PART_ORDER, Part, normalize_parts, parts_label
from ._tensors import (
    ExtraTensors,
    StorageAliasError,
    check_gradient_isolation,
    collect_groups,
    find_overlaps,
    inventory,
    resolve_device,
)

__all__ = ["OffloadManager"]

logger = logging.getLogger("ppo_lifecycle")


class OffloadManager:
    """Idempotent sleep/wake_up of one model, its optimizer state and gradients.

    Implements :class:`~ppo_lifecycle.Offloadable`. The driver decides *when*
    (see :func:`~ppo_lifecycle.plan_transitions`); this class is the mechanism.

    Args:
        model: the trained module (its parameters, ``.grad`` / ``.main_grad`` and buffers).
        optimizer: its optimizer; state tensors created later (Adam's first step)
            are found at each sleep.
        device: the device the model lives on; default: its first parameter's.
        backend: ``"host_copy"`` (everywhere), ``"torch_memory_saver"`` (CUDA, the
            ``cuda`` extra), ``"auto"`` (``host_copy``; pick the other explicitly),
            or an :class:`~ppo_lifecycle.OffloadBackend` instance.
        name: the model's name in logs and memory-saver tags (``actor``, ``critic``).
        keep_gradients: the plan keeps gradients resident while other parts sleep;
            checked here, at set-up, and again at each keep-gradients sleep.
        extra: more tensors per part that the module does not expose (flat grad
            buffers): ``{Part.GRADIENTS: lambda: [buffer]}``.
        on_release_process_groups: called by the first sleep after set-up or a wake-up
            (before anything moves).
        on_reload_process_groups: called by every ``wake_up()``, including one on a
            resident model (a failed retry may have torn the groups down).
        pin_memory / cache_host_buffers: host-copy options (see
            :class:`~ppo_lifecycle.HostCopyBackend`: pinned and kept for reuse on CUDA;
            on a CPU "device" the copy leaves the process and is freed at wake-up).
        hook_mode: ``torch_memory_saver`` hook mode (see its docs).

    Raises:
        StorageAliasError: (``ValueError``) ``keep_gradients=True`` while gradients
            share storage with parameters, buffers or optimizer state.
        ValueError: an unknown backend, or ``torch_memory_saver`` off CUDA / not installed.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: torch.device | str | None = None,
        backend: BackendName | OffloadBackend = "auto",
        name: str = "model",
        keep_gradients: bool = True,
        extra: ExtraTensors | None = None,
        on_release_process_groups: Callable[[], None] | None = None,
        on_reload_process_groups: Callable[[], None] | None = None,
        pin_memory: bool | None = None,
        cache_host_buffers: bool | None = None,
        hook_mode: HookMode | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = resolve_device(model, device)
        self.name = name
        self.keep_gradients = keep_gradients
        self.extra = extra
        self._on_release = on_release_process_groups
        self._on_reload = on_reload_process_groups
        self._asleep: set[Part] = set()
        self._offloaded_bytes: dict[Part, int] = {}
        # part -> the sleeping parts that hold some of its storage (shared storage sleeps
        # with the first part in PART_ORDER); found at sleep, used at wake-up
        self._held_by: dict[Part, set[Part]] = {}
        self._groups_live = True  # released by the first sleep after a wake-up
        if keep_gradients:
            check_gradient_isolation(model, optimizer, device=self.device, extra=extra)
        self.backend: OffloadBackend
        if isinstance(backend, str):
            if backend in ("auto", "host_copy"):
                self.backend = HostCopyBackend(
                    self.device, pin_memory=pin_memory, cache_host_buffers=cache_host_buffers
                )
            elif backend == "torch_memory_saver":
                self.backend = TorchMemorySaverBackend(self.device, name=name, hook_mode=hook_mode)
            else:
                raise ValueError(
                    f"backend: {backend!r} is not a backend; use 'auto', 'host_copy' "
                    "or 'torch_memory_saver' (CUDA, needs ppo-lifecycle[cuda])"
                )
        else:
            self.backend = backend

    # ----------------------------------------------------------------- state
    @property
    def is_asleep(self) -> bool:
        """Whether any part is off the device."""
        return bool(self._asleep)

    @property
    def asleep_parts(self) -> frozenset[Part]:
        """The parts currently off the device."""
        return frozenset(self._asleep)

    @property
    def resident_parts(self) -> frozenset[Part]:
        """The parts currently on the device."""
        return ALL_PARTS - self._asleep

    def _inventory(self) -> dict[Part, list[torch.Tensor]]:
        return inventory(self.model, self.optimizer, self.device, self.extra)

    def part_bytes(self) -> dict[Part, int]:
        """Bytes of each part: measured on the device if resident, as put to sleep if not."""
        resident = self.resident_parts
        groups = collect_groups(resident, self._inventory(), skip=self.backend.offloaded_keys())
        result: dict[Part, int] = {}
        for part in PART_ORDER:
            if part in resident:
                result[part] = sum(g.nbytes for g in groups[part])
            else:
                result[part] = self._offloaded_bytes.get(part, 0)
        return result

    def device_bytes(self) -> int:
        """Bytes the model's tensors hold on the device right now (measured)."""
        seen: dict[int, int] = {}
        away = self.backend.offloaded_keys()  # paused memory-saver storages keep their size
        for tensors in self._inventory().values():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage._cdata not in away:
                    seen[storage._cdata] = storage.nbytes()
        return sum(seen.values())

    @contextlib.contextmanager
    def allocation_region(self, part: Part) -> Iterator[None]:
        """Allocate ``part``'s tensors where its backend wants them.

        With ``torch_memory_saver``, storages that appear inside the block become
        part of the part's pausable region (no copy at the first sleep). With the
        host-copy backend this does nothing.

        Raises:
            RuntimeError: ``torch_memory_saver`` and ``part`` is asleep (a paused
                region cannot take allocations: wake it up first).
        """
        if not isinstance(self.backend, TorchMemorySaverBackend):
            yield
            return
        if part in self._asleep:
            raise RuntimeError(
                f"{self.name}: allocation_region({part.value!r}) while {part.value} is "
                f"asleep (its torch_memory_saver region is paused); call "
                f"wake_up(parts=[Part.{part.name}]) first"
            )
        before = self._keys(part)
        with self.backend.region(part):
            yield
        self.backend.adopt(part, self._keys(part) - before)

    def _keys(self, part: Part) -> set[int]:
        return {t.untyped_storage()._cdata for t in self._inventory()[part]}

    # ------------------------------------------------------------- lifecycle
    def sleep(self, *, parts: Iterable[Part] = ALL_PARTS) -> None:
        """Put ``parts`` to sleep (off the device); parts already asleep are skipped (logged).

        ``sleep(parts=KEEP_GRADIENTS)`` keeps the accumulated gradients resident.

        Raises:
            ValueError: ``parts`` is empty or not made of :class:`Part`.
            StorageAliasError: a kept part shares storage with a part that would leave.
        """
        requested = normalize_parts(parts)
        todo = requested - self._asleep
        if not todo:
            logger.info(
                "%s: sleep(%s) while already asleep; skipping",
                self.name,
                sorted(p.value for p in requested),
            )
            return
        kept = ALL_PARTS - self._asleep - todo
        tensors = self._inventory()
        overlaps = find_overlaps(kept, todo, tensors)
        if overlaps:
            names = ", ".join(f"{k.value} (kept) <-> {m.value} (asleep)" for k, m in overlaps)
            raise StorageAliasError(
                f"{self.name}: sleep(parts={sorted(p.value for p in requested)}) would move "
                f"memory that a kept part uses: {names}. Fix: put them to sleep together, "
                "or give gradients their own buffers."
            )
        groups = collect_groups(todo, tensors, skip=self.backend.offloaded_keys())
        if isinstance(self.backend, HostCopyBackend):
            for part in todo:  # every part checked before the first one moves
                self.backend.check_releasable(part, groups[part])
        if self._groups_live and self._on_release is not None:
            self._on_release()
        self._groups_live = False
        # before anything moves: a backend may give a storage a new identity
        owner = {g.key: part for part in todo for g in groups[part]}
        for part, part_tensors in tensors.items():
            for t in part_tensors:
                holder = owner.get(t.untyped_storage()._cdata)
                if holder is not None and holder is not part:
                    self._held_by.setdefault(part, set()).add(holder)
        for part in PART_ORDER:
            if part not in todo:
                continue
            self._offloaded_bytes[part] = self.backend.offload(part, groups[part])
            self._asleep.add(part)
        logger.info(
            "%s: asleep: %s (%d bytes), resident: %s",
            self.name,
            sorted(p.value for p in todo),
            sum(self._offloaded_bytes[p] for p in todo),
            sorted(p.value for p in self.resident_parts),
        )

    def wake_up(self, *, parts: Iterable[Part] = ALL_PARTS) -> None:
        """Bring the sleeping ``parts`` back (default: all); parts already resident are
        skipped. Process groups are reloaded by every call, also on a resident model.

        ``wake_up(parts=FORWARD_PARTS)`` is enough for a forward pass: the optimizer
        state (and gradients) stay asleep.

        Raises:
            ValueError: ``parts`` is empty or not made of :class:`Part`.
        """
        requested = normalize_parts(parts)
        todo = requested & self._asleep
        # A storage shared by two parts sleeps with the first in PART_ORDER (the
        # optimizer before the parameters): it comes back with whichever part needs it.
        shared = ({q for p in requested for q in self._held_by.get(p, ())} - todo) & self._asleep
        if shared:
            logger.info(
                "%s: wake_up(%s) also wakes %s (storage shared with the requested parts)",
                self.name,
                parts_label(requested),
                sorted(p.value for p in shared),
            )
            todo = todo | shared
        if not todo:
            logger.info(
                "%s: wake_up(%s) while already resident; ensuring process groups only",
                self.name,
                parts_label(requested),
            )
            if self._on_reload is not None:
                self._on_reload()
            self._groups_live = True
            return
        for part in reversed(PART_ORDER):
            if part in todo:
                self.backend.reload(part)
                self._asleep.discard(part)
                self._offloaded_bytes.pop(part, None)
                for held in self._held_by.values():
                    held.discard(part)
        if self._on_reload is not None:
            self._on_reload()
        self._groups_live = True
        if self._asleep:
            logger.info(
                "%s: woke %s; still asleep: %s",
                self.name,
                parts_label(todo),
                sorted(p.value for p in self._asleep),
            )
        else:
            logger.info("%s: resident", self.name)
