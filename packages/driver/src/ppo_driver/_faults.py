"""A fault during the run as :class:`RunFailed`: the fault in one line, naming the
process or the file, with what the run was doing; a lost Ray cluster recognised."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import ray

from ppo_driver.checkpoint import find_latest
from ppo_driver.pair import TrainPair
from ppo_driver.pump import InjectedFailure, NonFiniteError
from ppo_driver.rollout import (
    ClusterLost,
    RewardFailure,
    cluster_reachable,
    gcs_address,
)
from ppo_driver.startup import StartupError

log = logging.getLogger("ppo_driver")


class RunFailed(RuntimeError):
    """``train`` stopped on a fault during the run (a worker or engine process that
    died, a lost Ray cluster, an I/O error writing a checkpoint or the export, a
    worker's exception), after the same teardown as any other end: workers, engines and
    Ray shut down, nothing half-written left. The cause is ``__cause__``, its traceback
    is in ``train.log``. ``step``: steps completed when it happened; ``what``: the fault
    in one line (:func:`describe_fault`), with what the run was doing."""

    def __init__(self, *, step: int, what: str, run_dir: Path) -> None:
        self.step, self.what, self.run_dir = step, what, run_dir
        ckpt_dir = run_dir / "checkpoints"
        self.checkpoint = find_latest(ckpt_dir) if ckpt_dir.is_dir() else None
        self.cluster_lost = False  # the Ray cluster is gone (Ray calls would block)
        super().__init__(f"stopped at step {step}: {what}")


_FILE_ONLY = {"ppo_file_only": True}
"""``extra=`` of a log record for ``train.log`` only (a fault's traceback): the terminal
gets the one-line ``ppo-driver:`` message instead."""


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "ppo_file_only", False)


_TEARDOWN_WITHOUT_RAY = frozenset({"trace and reward plot", "metrics file"})
"""Teardown steps that still run when the Ray cluster is gone (the rest would block on
the lost GCS until Ray ends the process)."""


_REPORTED_ELSEWHERE = (StartupError, InjectedFailure, NonFiniteError, RewardFailure)
"""Exceptions ``train`` raises as they are (each has its own message in the CLI)."""


def describe_fault(exc: BaseException) -> str:
    """``exc`` in one line for the user: what failed, naming the file or the process
    (an exception raised in a Ray worker: the worker's exception and where it ran)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        inner = describe_fault(cause) if cause is not None else _first_line(exc)
        # the error as raised by ray.get is also the cause's class: not every attribute
        # of RayTaskError is set on it
        title = getattr(exc, "proctitle", None) or getattr(exc, "function_name", "a Ray task")
        where = f"pid {getattr(exc, 'pid', '?')} on {getattr(exc, 'ip', '?')}"
        return f"{inner} (in {title}, {where})"
    if isinstance(exc, OSError) and exc.strerror:
        names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
        where = f": {' -> '.join(names)}" if names else ""
        return f"{exc.strerror} ({type(exc).__name__}{where})"
    if isinstance(exc, ray.exceptions.RayActorError) and not str(exc).strip():
        return f"a Ray actor died ({type(exc).__name__})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _from_ray(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ray error or was raised from one (a :class:`WorkerLost`
    wraps the ``RayActorError`` of a dead rank, which a lost cluster also causes)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ray.exceptions.RayError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _name_the_worker(exc: Exception, pair: TrainPair | None) -> Exception:
    """``exc`` as the :class:`WorkerLost` of the trainer rank it is about, when a trainer
    worker died and the call that saw it was not made through its group (an engine's
    restore calls the actor's ranks directly); otherwise ``exc``."""
    if pair is None or not isinstance(exc, ray.exceptions.RayActorError):
        return exc
    for group in (pair.actor, pair.critic):
        if group.owns(exc):
            return group.lost(exc)
    return exc


def _fault(
    exc: Exception,
    pair: TrainPair | None,
    *,
    step: int,
    doing: str,
    run_dir: Path,
    cluster_lost: threading.Event,
) -> RunFailed:
    """A fault during the run (``step`` steps done, while ``doing``) as
    :class:`RunFailed`; its traceback goes to ``train.log`` (not the terminal). A Ray
    error (or one raised from it) while the cluster's GCS does not answer is a lost
    cluster: the teardown then skips what would wait for it."""
    lost = isinstance(exc, ClusterLost) or (_from_ray(exc) and not cluster_reachable())
    what = describe_fault(_name_the_worker(exc, pair))
    if lost:
        cluster_lost.set()
        if not isinstance(exc, ClusterLost):
            what = f"the Ray cluster's head ({gcs_address()}) does not answer: {what}"
    failed = RunFailed(step=step, what=f"{what}; while {doing}", run_dir=run_dir)
    failed.cluster_lost = lost
    log.error("%s; the traceback:", failed, exc_info=exc, extra=_FILE_ONLY)
    return failed
