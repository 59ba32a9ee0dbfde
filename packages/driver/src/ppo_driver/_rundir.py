"""The run directory before anything starts: created and proven writable, locked for
the life of the run (``run.lock``, naming its holder), and claimed (a fresh run needs it
empty; ``--overwrite`` empties it; ``--resume`` continues what is there)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from ppo_driver.startup import StartupError

log = logging.getLogger("ppo_driver")


LOCK_FILE = "run.lock"
"""In the run directory: locked (``flock``) by the run using it; names its holder."""


def _open_run_dir(run_dir: Path) -> None:
    """Create the run directory and prove it writable, or refuse with the reason."""
    if run_dir.exists() and not run_dir.is_dir():
        raise StartupError(f"--run-dir {run_dir} is a file, not a directory; choose another path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(
            f"--run-dir {run_dir} cannot be used: {exc.strerror or exc} "
            f"({type(exc).__name__}: {exc.filename or run_dir}); choose a directory you can "
            "create and write to"
        ) from None


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/run.lock`` held for the life of a run.

    The file names the holder (pid, host, start time, command) for the run that finds
    it taken. The kernel drops the lock when the holder's process ends, however it ends
    (the descriptor is not inherited by Ray's processes); the file itself stays.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        path = run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StartupError(f"cannot create the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise StartupError(
                f"run directory {run_dir} is in use by another run ({holder}; lock file "
                f"{path}); wait for that run to end or stop it, or choose another --run-dir"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock
            self._fd = None


def _lock_holder(fd: int) -> str:
    """The holder as its lock file describes it (it writes that right after locking)."""
    for _ in range(20):
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0) or b"null")
        except ValueError:
            info = None
        if isinstance(info, dict):
            return (
                f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
                f"{info.get('command')}"
            )
        time.sleep(0.05)
    return "holder not recorded yet"


_RUN_FILES = frozenset({"config.yaml", "train.log", "metrics.jsonl", "checkpoints"})


def _failed_start(run_dir: Path, names: Sequence[str]) -> bool:
    """Only what a run that stopped before finishing a step leaves behind (its config,
    its log, an empty metrics file or checkpoint folder): nothing a new run could lose."""
    if not set(names) <= _RUN_FILES | {"trace.json"}:
        return False
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    if metrics.exists() and (not metrics.is_file() or metrics.stat().st_size > 0):
        return False
    return not ckpts.exists() or (ckpts.is_dir() and not any(ckpts.iterdir()))


def _claim_contents(run_dir: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """A fresh run needs an empty run directory (``--overwrite`` empties it; returns what
    it removed). ``--resume`` continues what is there. A directory a failed start-up left
    (no step finished) is reused as it is: the new ``config.yaml`` replaces the old one
    and ``train.log`` goes on after the failed attempt's lines."""
    others = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if not others or resume or (not overwrite and _failed_start(run_dir, others)):
        return []
    if overwrite:
        if not set(others) & _RUN_FILES:  # a typo must not empty an unrelated directory
            raise StartupError(
                f"--overwrite: {run_dir} does not look like a ppo-driver run directory (none "
                f"of {', '.join(sorted(_RUN_FILES))}); not deleting its contents. Choose "
                "another --run-dir, or empty it yourself"
            )
        for name in others:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        return others
    shown = ", ".join(others[:6]) + (", ..." if len(others) > 6 else "")
    raise StartupError(
        f"run directory {run_dir} is not empty ({shown}). A new run there would mix with "
        "the old run's files, and checkpoint pruning (which keeps the highest step numbers) "
        "would delete the new run's own checkpoints. Continue the old run with --resume, "
        "start over with --overwrite (deletes the directory's contents), or choose another "
        "--run-dir"
    )
