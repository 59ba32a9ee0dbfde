"""Atomic checkpoints: write everything into a side directory, then rename it in place.

Layout of one checkpoint (never pickle: safetensors for tensors, JSON for the rest)::

    <run>/checkpoints/step_000005/
        actor/            written by the actor workers (model, optimizer, scheduler)
        critic/           written by the critic workers
        driver.json       counters, sampler state, replay state, RNG (python), config
        tensors.safetensors   driver-side tensors (torch RNG, replay payloads)
        manifest.json     written last: every other file's size and sha256
    <run>/checkpoints/latest    the name of the newest complete checkpoint

A checkpoint directory exists under its final name only once it is complete: the
driver writes ``step_000005.partial``, writes the manifest last, fsyncs the files and
renames it. ``latest`` is replaced atomically after the rename. A crash at any point
leaves either the previous checkpoint or the new one, never a half-written one that
``--resume`` would read.

Damage after the fact (a truncated or overwritten file, a disk error) is caught by
:func:`verify_checkpoint` before ``--resume`` starts anything: every file the manifest
lists must exist with its size and sha256. A checkpoint written before manifests existed
(ppo-driver 0.1.0 development builds) is still accepted, after a structural check
(every JSON file parses, every safetensors file is as long as its header says); its
contents cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import load_file, save_file

from ._json import JSONObject, as_int
from ._latest import _PARTIAL, _complete, _name, checkpoint_step, complete_checkpoints, find_latest

__all__ = [
    "MANIFEST",
    "CheckpointDamaged",
    "CheckpointData",
    "RngState",
    "checkpoint_step",
    "complete_checkpoints",
    "find_latest",
    "input_fingerprint",
    "load_checkpoint",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
"""Written last inside each checkpoint: ``{"files": {relative path: {"bytes", "sha256"}}}``."""


class CheckpointDamaged(ValueError):
    """A checkpoint file is missing, truncated, altered or unreadable."""

    def __init__(self, checkpoint: Path, file: Path, reason: str) -> None:
        self.checkpoint, self.file, self.reason = checkpoint, file, reason
        super().__init__(f"checkpoint {checkpoint} is damaged: {file}: {reason}")


@dataclass
class CheckpointData:
    path: Path
    step: int
    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]


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


class RngState(TypedDict):
    """The driver's Python RNG state in ``driver.json``: ``random.getstate()``'s version,
    its Mersenne Twister words and the cached Gaussian (a JSON list once read back)."""

    python_random: tuple[int, list[int], float | None]


def rng_state() -> tuple[RngState, dict[str, torch.Tensor]]:
    """The driver process's RNG state: Python's (JSON) and torch's CPU generator (tensor)."""
    version, internal, gauss = random.getstate()
    return (
        {"python_random": (version, list(internal), gauss)},
        {"rng/torch_cpu": torch.get_rng_state()},
    )


def restore_rng(state: RngState, tensors: Mapping[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(tensors["rng/torch_cpu"])


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    *,
    state: Mapping[str, object],
    tensors: Mapping[str, torch.Tensor],
    write_models: Callable[[Path], None],
    keep: int = 2,
    crash_hook: Callable[[str], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and return its final path.

    ``write_models(tmp_dir)`` writes the workers' files (``actor/``, ``critic/``) into
    the side directory. ``crash_hook(point)`` is called at ``"after_models"`` and
    ``"before_rename"`` (tests inject crashes there: what it raises is left as a killed
    process would leave it). Any other failure (a full disk, a worker that raised)
    removes the side directory before it propagates: nothing half-written stays, and
    the space it took is free again; the previous checkpoint stays the latest.
    """
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(step)
    tmp = root / (_name(step) + _PARTIAL)
    latest_tmp = root / f"latest.tmp{os.getpid()}"
    crashing = False

    def hook(point: str) -> None:
        nonlocal crashing
        if crash_hook is not None:
            crashing = True
            crash_hook(point)
            crashing = False

    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write_models(tmp)
        hook("after_models")
        state_json = json.dumps({"step": step, **state}, indent=1, sort_keys=True)
        (tmp / "driver.json").write_text(state_json)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            str(tmp / "tensors.safetensors"),
        )
        _write_manifest(tmp)  # last: a manifest vouches for every file written before it
        _fsync_tree(tmp)
        hook("before_rename")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
    except BaseException:
        if not crashing:
            shutil.rmtree(tmp, ignore_errors=True)
            latest_tmp.unlink(missing_ok=True)
        raise
    _prune(root, keep=keep)
    return final


def _prune(root: Path, *, keep: int) -> None:
    for stale in root.glob(f"step_*{_PARTIAL}"):
        shutil.rmtree(stale, ignore_errors=True)
    done = _complete(root)
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path) -> CheckpointData:
    """The driver's part of a checkpoint; a damaged file raises :class:`CheckpointDamaged`
    naming it (run :func:`verify_checkpoint` first to check every file)."""
    path = Path(path)
    state = _read_json(path, path / "driver.json")
    try:
        tensors = load_file(str(path / "tensors.safetensors"))
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointDamaged(path, path / "tensors.safetensors", str(exc)) from exc
    return CheckpointData(path=path, step=as_int(state["step"]), state=state, tensors=tensors)


# ------------------------------------------------------------------- integrity


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


#: The files of a model directory that fix what its ids and shapes mean.
_MODEL_META = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
_EDGE = 4 << 20  # bytes read at each end of a weights file


def input_fingerprint(path: str | Path | None) -> dict[str, str] | None:
    """What identifies an input of a run (a prompt file or a model directory), to tell
    on ``--resume`` whether it is the same input under another path, or another one
    under the same path: ``{"path": resolved path, "sha256": digest}``.

    A file is digested whole. A directory: its config and tokenizer files whole, and of
    each ``*.safetensors`` file its name, size and first and last 4 MiB (the header and
    the outermost tensors; the whole weights would take minutes at a start). ``None``
    for ``None``; a path that does not exist gets the digest ``"missing"``."""
    if path is None:
        return None
    root = Path(path).expanduser().resolve()
    if root.is_file():
        return {"path": str(root), "sha256": _sha256(root)}
    if not root.is_dir():
        return {"path": str(root), "sha256": "missing"}
    digest = hashlib.sha256()
    for name in _MODEL_META:
        if (root / name).is_file():
            digest.update(f"{name}:{_sha256(root / name)}\n".encode())
    for weights in sorted(root.glob("*.safetensors")):
        size = weights.stat().st_size
        with weights.open("rb") as fh:
            head = fh.read(_EDGE)
            fh.seek(max(size - _EDGE, 0))
            tail = fh.read(_EDGE)
        edges = hashlib.sha256(head + tail).hexdigest()
        digest.update(f"{weights.name}:{size}:{edges}\n".encode())
    return {"path": str(root), "sha256": digest.hexdigest()}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(root: Path) -> None:
    files = {
        p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(root)
    }
    (root / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1))


def _read_json(checkpoint: Path, path: Path) -> JSONObject:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointDamaged(checkpoint, path, "missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointDamaged(checkpoint, path, f"not readable JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointDamaged(checkpoint, path, "not a JSON object")
    return value


def _check_safetensors_length(checkpoint: Path, path: Path) -> None:
    """A safetensors file must be exactly as long as its header says (catches truncation
    without reading the tensors)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size:
                raise ValueError(f"header length {header_len} exceeds the file")
            header = json.loads(fh.read(header_len))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointDamaged(checkpoint, path, f"not a safetensors file ({exc})") from exc
    if size != 8 + header_len + end:
        raise CheckpointDamaged(
            checkpoint, path, f"{size} bytes, its header describes {8 + header_len + end}"
        )


def verify_checkpoint(path: str | Path) -> bool:
    """Check a complete checkpoint's files before anything reads them.

    With a manifest (every checkpoint this version writes): every listed file exists
    with its recorded size and sha256; returns True. Without one (written before
    manifests existed): every JSON file parses and every safetensors file is as long as
    its header says; returns False (the contents could not be verified). Raises
    :class:`CheckpointDamaged` naming the first bad file.
    """
    root = Path(path)
    manifest = root / MANIFEST
    if not manifest.exists():
        if not (root / "driver.json").exists():
            raise CheckpointDamaged(root, root / "driver.json", "missing")
        for f in _files(root):
            if f.suffix == ".json":
                _read_json(root, f)
            elif f.suffix == ".safetensors":
                _check_safetensors_length(root, f)
        return False
    listed = _read_json(root, manifest).get("files")
    if not isinstance(listed, dict) or "driver.json" not in listed:
        raise CheckpointDamaged(root, manifest, "no file list (or one without driver.json)")
    for rel, want in sorted(listed.items()):
        f = root / rel
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int)):
            raise CheckpointDamaged(root, manifest, f"no size recorded for {rel}")
        if not f.is_file():
            raise CheckpointDamaged(root, f, "missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointDamaged(root, f, f"{size} bytes, the manifest says {want['bytes']}")
        if _sha256(f) != want["sha256"]:
            raise CheckpointDamaged(root, f, "contents differ from the manifest (sha256)")
    return True
