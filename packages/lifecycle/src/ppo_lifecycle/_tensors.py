"""Finding the tensors (and their storages) that make up each part."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ._parts import PART_ORDER, Part

__all__ = ["StorageAliasError", "check_gradient_isolation"]

#: Extra tensors a trainer owns outside ``module`` / ``optimizer`` (contiguous
#: gradient buffers, flat parameter buffers), per part.
ExtraTensors = Mapping[Part, Callable[[], Iterable[torch.Tensor]]]


class StorageAliasError(ValueError):
    """Two parts share device memory, so one cannot leave while the other stays."""


def _walk_state(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _walk_state(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _walk_state(item)


Inventory = dict[Part, list[torch.Tensor]]


def inventory(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    extra: ExtraTensors | None = None,
) -> Inventory:
    """Every tensor of every part on ``device``, gathered in one pass over ``module``."""
    params = list(module.parameters())
    out: Inventory = {part: [] for part in Part}
    out[Part.PARAMETERS] = [p for p in params if p.device == device]
    out[Part.BUFFERS] = [b for b in module.buffers() if b.device == device]
    grads = out[Part.GRADIENTS]
    for param in params:
        if param.grad is not None and param.grad.device == device:
            grads.append(param.grad)
        main_grad = getattr(param, "main_grad", None)
        if isinstance(main_grad, torch.Tensor) and main_grad.device == device:
            grads.append(main_grad)
    if optimizer is not None:
        out[Part.OPTIMIZER] = [
            t
            for state in optimizer.state.values()
            for t in _walk_state(state)
            if t.device == device
        ]
    if extra is not None:
        for part, tensors in extra.items():
            out[Part(part)].extend(t for t in tensors() if t.device == device)
    return out


@dataclass
class StorageGroup:
    """One storage and every reachable tensor that lives in it."""

    storage: torch.UntypedStorage
    tensors: list[torch.Tensor]

    @property
    def key(self) -> int:
        key: int = self.storage._cdata
        return key

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes()


def collect_groups(
    parts: Iterable[Part], tensors: Inventory, *, skip: Iterable[int] = ()
) -> dict[Part, list[StorageGroup]]:
    """Unique, non-empty storages per part, with their tensors.

    A storage reachable from two parts (tied weights, a buffer aliasing a
    parameter) belongs to the first part in the fixed part order, so it moves
    exactly once; its tensors from the other parts are grouped with it. Storages
    whose key is in ``skip`` (already asleep) are left out.
    """
    skipped = set(skip)
    owner: dict[int, Part] = {}
    groups: dict[int, StorageGroup] = {}
    for part in PART_ORDER:
        for tensor in tensors[part]:
            storage = tensor.untyped_storage()
            key: int = storage._cdata
            if key in skipped or storage.nbytes() == 0:
                continue
            if key in groups:
                groups[key].tensors.append(tensor)
            else:
                owner[key] = part
                groups[key] = StorageGroup(storage, [tensor])
    wanted = set(parts)
    result: dict[Part, list[StorageGroup]] = {part: [] for part in PART_ORDER if part in wanted}
    for key, group in groups.items():
        if owner[key] in wanted:
            result[owner[key]].append(group)
    return result


def _ranges(parts: Iterable[Part], tensors: Inventory) -> list[tuple[int, int, Part]]:
    out: set[tuple[int, int, Part]] = set()
    for part in parts:
        for tensor in tensors[part]:
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size:
                start = storage.data_ptr()
                out.add((start, start + size, part))
    return sorted(out)


def find_overlaps(
    kept: Iterable[Part], moved: Iterable[Part], tensors: Inventory
) -> list[tuple[Part, Part]]:
    """Pairs (kept part, moved part) whose device memory ranges intersect."""
    kept_ranges = _ranges(kept, tensors)
    moved_ranges = _ranges(moved, tensors)
    events = sorted(
        [(start, end, part, True) for start, end, part in kept_ranges]
        + [(start, end, part, False) for start, end, part in moved_ranges]
    )
    pairs: set[tuple[Part, Part]] = set()
    open_kept: list[tuple[int, Part]] = []
    open_moved: list[tuple[int, Part]] = []
    for start, end, part, is_kept in events:
        open_kept = [(e, p) for e, p in open_kept if e > start]
        open_moved = [(e, p) for e, p in open_moved if e > start]
        if is_kept:
            pairs.update((part, p) for _, p in open_moved)
            open_kept.append((end, part))
        else:
            pairs.update((p, part) for _, p in open_kept)
            open_moved.append((end, part))
    return sorted(pairs)


def check_gradient_isolation(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: torch.device | str | None = None,
    extra: ExtraTensors | None = None,
) -> None:
    """Refuse a set-up where gradients share memory with another part.

    Keeping gradients on the device while parameters (or optimizer state, or
    buffers) leave it is only sound when no gradient byte lives inside their
    storage. MXFP8 parameters under a distributed optimizer, for example, reuse
    the gradient buffer for parameter data. Call this at set-up, before any step.

    Raises:
        StorageAliasError: (a ``ValueError``) naming the overlapping parts and the fix.
    """
    dev = resolve_device(module, device)
    others = [p for p in Part if p is not Part.GRADIENTS]
    overlaps = find_overlaps([Part.GRADIENTS], others, inventory(module, optimizer, dev, extra))
    if overlaps:
        names = ", ".join(f"{kept.value}<->{moved.value}" for kept, moved in overlaps)
        raise StorageAliasError(
            f"keep_gradients=True: gradient storage overlaps {names} on {dev}; "
            "putting parameters to sleep would free or overwrite the resident gradients "
            "(as with MXFP8 parameters under a distributed optimizer). Fix: give "
            "gradients their own buffers, or set keep_gradients=False and put "
            "gradients to sleep together with parameters (sleep(parts=ALL_PARTS))."
        )


def normalize_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index for CUDA (``cuda`` -> ``cuda:<current>``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return normalize_device(device)
    for param in module.parameters():
        return param.device
    for buf in module.buffers():
        return buf.device
    raise ValueError("device: the module has no parameters or buffers; pass device= explicitly")
