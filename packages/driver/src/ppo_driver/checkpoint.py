"""Atomic checkpoints: write everything into a side directory, then rename it in place.

Layout of one checkpoint (never pickle: safetensors for tensors, JSON for the rest)::

    <run>/checkpoints/step_000005/
        actor/            written by the actor workers (model, optimizer, scheduler)
        critic/           written by the critic workers
        driver.json       counters, sampler state, replay state, RNG (python), config
        tensors.safetensors   driver-side tensors (torch RNG, replay payloads)
    <run>/checkpoints/latest    the name of the newest complete checkpoint

A checkpoint directory exists under its final name only once it is complete: the
driver writes ``step_000005.partial``, fsyncs the files and renames it. ``latest`` is
replaced atomically after the rename. A crash at any point leaves either the previous
checkpoint or the new one, never a half-written one that ``--resume`` would read.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "CheckpointData",
    "find_latest",
    "load_checkpoint",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
]

_PARTIAL = ".partial"


@dataclass
class CheckpointData:
    path: Path
    step: int
    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The driver process's RNG state: Python's (JSON) and torch's CPU generator (tensor)."""
    version, internal, gauss = random.getstate()
    return (
        {"python_random": [version, list(internal), gauss]},
        {"rng/torch_cpu": torch.get_rng_state()},
    )


def restore_rng(state: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(tensors["rng/torch_cpu"])


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    *,
    state: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    write_models: Callable[[Path], None],
    keep: int = 2,
    crash_hook: Callable[[str], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and return its final path.

    ``write_models(tmp_dir)`` writes the workers' files (``actor/``, ``critic/``) into
    the side directory. ``crash_hook(point)`` is called at ``"after_models"`` and
    ``"before_rename"`` (tests inject crashes there).
    """
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(step)
    tmp = root / (_name(step) + _PARTIAL)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_models(tmp)
    if crash_hook is not None:
        crash_hook("after_models")
    (tmp / "driver.json").write_text(json.dumps({"step": step, **state}, indent=1, sort_keys=True))
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        str(tmp / "tensors.safetensors"),
    )
    _fsync_tree(tmp)
    if crash_hook is not None:
        crash_hook("before_rename")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / f"latest.tmp{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _prune(root, keep=keep)
    return final


def _complete(root: Path) -> list[Path]:
    out = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(_PARTIAL)]
    return sorted(out, key=lambda p: int(p.name.split("_")[1]))


def _prune(root: Path, *, keep: int) -> None:
    for stale in root.glob(f"step_*{_PARTIAL}"):
        shutil.rmtree(stale, ignore_errors=True)
    done = _complete(root)
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(checkpoints_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (``latest`` if valid, else the highest step)."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return None
    pointer = root / "latest"
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / "driver.json").exists():
            return candidate
    done = [p for p in _complete(root) if (p / "driver.json").exists()]
    return done[-1] if done else None


def load_checkpoint(path: str | Path) -> CheckpointData:
    path = Path(path)
    state = json.loads((path / "driver.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    return CheckpointData(path=path, step=int(state["step"]), state=state, tensors=tensors)
