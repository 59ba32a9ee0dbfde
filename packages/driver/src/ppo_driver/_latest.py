"""A run's checkpoints found by their names, without torch: what the watcher of an
abrupt end (:mod:`ppo_driver._watch`) needs, quickly, after the driver is gone.
:mod:`ppo_driver.checkpoint` writes, verifies and loads them."""

from __future__ import annotations

import re
from pathlib import Path

_PARTIAL = ".partial"
_COMPLETE_NAME = re.compile(r"step_(\d+)")


def _name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint directory's name (``step_000005`` -> 5), else None."""
    match = _COMPLETE_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _complete(root: Path) -> list[Path]:
    out = [p for p in root.glob("step_*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(out, key=lambda p: checkpoint_step(p) or 0)


def complete_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """The complete (renamed) checkpoints, oldest first; their files are not verified."""
    root = Path(checkpoints_dir)
    return [p for p in _complete(root) if (p / "driver.json").exists()] if root.is_dir() else []


def find_latest(checkpoints_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (``latest`` if valid, else the highest step)."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return None
    pointer = root / "latest"
    try:
        name = pointer.read_text().strip() if pointer.is_file() else ""
    except (OSError, UnicodeDecodeError):
        name = ""  # an unreadable pointer: fall back to the highest complete step
    candidate = root / name
    if name and checkpoint_step(candidate) is not None and (candidate / "driver.json").exists():
        return candidate
    done = complete_checkpoints(root)
    return done[-1] if done else None


def last_checkpoint_note(run_dir: str | Path) -> str:
    """Where a stopped run can be continued from, for the user."""
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        return (
            f"{ckpt_dir} is not a directory: no checkpoint can be found there (put the "
            "checkpoints directory back before --resume)"
        )
    latest = find_latest(ckpt_dir)
    if latest is None:
        return f"no checkpoint was written in {run_dir}: --resume would start from step 0"
    return f"last complete checkpoint: {latest} ({checkpoint_step(latest)} step(s) done)"
