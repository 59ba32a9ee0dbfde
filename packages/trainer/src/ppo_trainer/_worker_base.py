"""What the actor and the critic worker share: the backend they build, idempotent
sleep/wake_up, the lifecycle options of their work calls and their timeline, and the
checkpoint files (one directory per rank, no pickle).

The driver owns the plan (when to sleep, when to save); the workers own the mechanism.
Model memory is moved only by ``sleep`` / ``wake_up`` (idempotent), which the driver
calls directly or asks for around one call with the lifecycle options ``wake_first`` /
``sleep_after`` (one Ray round trip per model per chunk).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from ppo_lifecycle import ALL_PARTS, Action, Part, Role, Transition

from ppo_trainer._backend import Backend, FrozenModel, Mesh, TrainModel, get_backend
from ppo_trainer._config import ActorConfig, CriticConfig
from ppo_trainer._serialize import load_state, save_state

__all__ = ["EmptyStepError", "Timeline", "WorkerBase", "lifecycle_options", "refuse_non_finite"]

log = logging.getLogger(__name__)

_CHECKPOINT_FORMAT = 1

Timeline = list[tuple[str, float, float]]
"""``(label, t0, t1)`` per piece of one worker call, wall-clock ``time.time()`` seconds."""


class EmptyStepError(ValueError):
    """A step (or ``train`` call) without a single valid token: nothing may be updated."""


def _parts_from(parts: Iterable[Part | str] | None) -> frozenset[Part]:
    """Validate a ``parts=`` / ``sleep_after=`` argument (``None``: every part)."""
    if parts is None:
        return ALL_PARTS
    out: set[Part] = set()
    for item in parts:
        try:
            out.add(Part(item))
        except ValueError:
            raise ValueError(
                f"parts={item!r} is invalid: use members of ppo_lifecycle.Part "
                f"({', '.join(p.value for p in Part)})"
            ) from None
    if not out:
        raise ValueError(
            "parts=() is invalid: pass at least one Part (ALL_PARTS or KEEP_GRADIENTS)"
        )
    return frozenset(out)


def refuse_non_finite(model: TrainModel, where: str, values: Mapping[str, float]) -> None:
    """Raise ``FloatingPointError`` naming the first non-finite quantity, BEFORE the
    optimizer step (the accumulated gradients are discarded): a non-finite loss or
    gradient norm would otherwise be clipped to a silent no-op or poison the weights."""
    for name, value in values.items():
        if not math.isfinite(value):
            model.zero_grad()
            raise FloatingPointError(
                f"{where}: {name} = {value!r} is not finite; no optimizer step was taken "
                "(gradients discarded). Look for rewards, returns or advantages far out of "
                "range (e.g. a reward function returning huge values)"
            )


_W = TypeVar("_W", bound="WorkerBase")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class WorkerBase:
    """The state both workers share (rank, backend, what is asleep, the last timeline,
    the global step), idempotent sleep/wake_up (models are moved by the backend), the
    lifecycle options of their work calls (:func:`lifecycle_options`) and checkpoints.

    Implements ``ppo_lifecycle.Offloadable``: parts already off the device are skipped,
    so ``sleep(parts=KEEP_GRADIENTS)`` followed by ``sleep()`` also puts the gradients to
    sleep; a sleep with nothing left to move is a logged no-op.
    """

    def __init__(
        self,
        config: ActorConfig | CriticConfig,
        *,
        role: Role,
        rank: int,
        world_size: int,
        dist_init_method: str | None,
    ) -> None:
        self.rank = rank
        self._name = "ActorWorker" if role is Role.ACTOR else "CriticWorker"
        self._role = role
        self._offload_off = config.offload_backend == "none"  # sleep/wake_up move nothing
        self._timeline: Timeline = []
        self._asleep_parts: frozenset[Part] = frozenset()
        self._frozen_asleep = False  # the reference model (actor with a KL loss)
        self._groups_live = True
        self._backend: Backend = get_backend(config.backend)(
            config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
        )
        self.global_step = 0

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        """(model, is_the_trained_one)."""
        raise NotImplementedError

    @property
    def is_asleep(self) -> bool:
        """Whether any part of the worker's model memory is off the device."""
        return bool(self._asleep_parts)

    @property
    def asleep_parts(self) -> frozenset[Part]:
        """The parts of the trained model currently off the device."""
        return self._asleep_parts

    def mesh(self) -> Mesh:
        """This rank's place in the group (data / tensor / pipeline parallel), from the
        backend: the driver splits rows over ``dp_rank`` only."""
        return self._backend.mesh

    def sleep(self, *, parts: Iterable[Part] | None = None) -> None:
        """Put ``parts`` (default: all) of the trained model, and all of the frozen
        reference model, to sleep (off the device). Parts already asleep are skipped
        (logged no-op). The process groups are released by the sleep that follows a
        wake-up."""
        requested = _parts_from(parts)
        todo = requested - self._asleep_parts
        if not todo:
            log.info("%s.sleep() while already asleep: nothing to do", self._name)
            return
        if self._offload_off:  # offload off (debugging): bookkeeping only
            log.info("%s.sleep(): offload_backend='none', nothing leaves the device", self._name)
            self._asleep_parts = self._asleep_parts | todo
            return
        for model, trained in self._models():
            if trained:  # all of them: a part that woke with one sharing its storage too
                model.sleep(parts=requested)
            elif not self._frozen_asleep:
                model.sleep(parts=ALL_PARTS)
        self._frozen_asleep = True
        if self._groups_live:
            self._backend.release_process_groups()
            self._groups_live = False
        self._asleep_parts = self._asleep_parts | todo

    def wake_up(self, *, parts: Iterable[Part] | None = None) -> None:
        """Bring ``parts`` (default: all) of the trained model back, and all of the
        reference model; a forward needs only ``FORWARD_PARTS`` (the optimizer state
        stays asleep). With nothing of ``parts`` asleep it only re-establishes the
        process groups (a retry after a failure between wake_up and sleep)."""
        requested = _parts_from(parts)
        todo = requested & self._asleep_parts
        if self._offload_off:  # nothing left the device
            self._asleep_parts = self._asleep_parts - todo
            return
        if not todo:
            log.info("%s.wake_up() while resident: ensuring process groups only", self._name)
            self._backend.restore_process_groups()
            self._groups_live = True
            return
        for model, trained in self._models():
            if trained:
                model.wake_up(parts=todo)
            elif self._frozen_asleep:
                model.wake_up(parts=ALL_PARTS)
        self._frozen_asleep = False
        self._backend.restore_process_groups()
        self._groups_live = True
        self._asleep_parts = self._asleep_parts - todo

    def last_timeline(self) -> Timeline:
        """The timeline of the latest call to a method that takes the lifecycle options
        ``wake_first`` / ``sleep_after`` (recorded whether or not they were passed):
        ``(label, t0, t1)`` in order, wall-clock ``time.time()`` seconds. Labels: ``"<role>.wake_up"``
        (with ``wake_first``), the method's name for the work, ``"<role>.sleep(keep_grads)"``
        / ``"<role>.sleep(all)"`` (with ``sleep_after``), worded as
        ``str(ppo_lifecycle.Transition(...))``; ``<role>`` is ``actor`` or ``critic``.
        A call that raised keeps the entries it completed. Other methods leave it alone."""
        return list(self._timeline)

    def _with_lifecycle(
        self,
        label: str,
        work: Callable[[], _R],
        *,
        wake_first: bool | Iterable[Part],
        sleep_after: Iterable[Part] | None,
    ) -> _R:
        """``wake_up(parts=...)`` if asked, the work, then ``sleep(parts=sleep_after)`` if
        asked and the work succeeded; each timed into a fresh timeline."""
        timeline: Timeline = []
        self._timeline = timeline
        parts = None if sleep_after is None else _parts_from(sleep_after)  # before any work
        wake: frozenset[Part] | None = None
        if wake_first is True:
            wake = ALL_PARTS
        elif wake_first is not False:
            wake = _parts_from(wake_first)
        if wake is not None:
            t0 = time.time()
            self.wake_up(parts=wake)
            timeline.append((str(Transition(self._role, Action.WAKE_UP, wake)), t0, time.time()))
        t0 = time.time()
        out = work()
        timeline.append((label, t0, time.time()))
        if parts is not None:
            t0 = time.time()
            self.sleep(parts=parts)
            timeline.append((str(Transition(self._role, Action.SLEEP, parts)), t0, time.time()))
        return out

    def _require_awake(self, what: str, parts: frozenset[Part] = ALL_PARTS) -> None:
        """Refuse ``what`` while any of the ``parts`` it needs is asleep."""
        missing = parts & self._asleep_parts
        if missing:
            names = sorted(p.value for p in missing)
            raise RuntimeError(
                f"{self._name}.{what}() called while asleep ({names} asleep): the driver "
                f"must call wake_up(parts=...) with them first, or pass wake_first=True"
            )

    # ---- checkpoints: safetensors + JSON under path/rank{rank:05d}

    def _write_checkpoint(
        self, path: str | os.PathLike[str], *, model: TrainModel, config: dict[str, Any]
    ) -> None:
        """Save ``model``'s state (model, optimizer, scheduler) with the global step."""
        state = {
            "format": _CHECKPOINT_FORMAT,
            "role": self._role.value,
            "global_step": self.global_step,
            "config": config,
            "backend": model.checkpoint_state(),
        }
        save_state(Path(path) / f"rank{self.rank:05d}", state)

    def _read_checkpoint(self, path: str | os.PathLike[str], *, model: TrainModel) -> None:
        """Restore what :meth:`_write_checkpoint` saved into ``model`` and the global step."""
        d = Path(path) / f"rank{self.rank:05d}"
        if not (d / "state.json").is_file():
            raise FileNotFoundError(
                f"no checkpoint for rank {self.rank} under {path} (expected {d})"
            )
        state: dict[str, Any] = load_state(d)
        if state.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint {d} has format {state.get('format')!r}, expected 1")
        role = self._role.value
        if state["role"] != role:
            article = "an" if role == "actor" else "a"
            raise ValueError(f"checkpoint {path} holds a {state['role']!r}, not {article} {role}")
        model.load_checkpoint_state(state["backend"])
        self.global_step = int(state["global_step"])


def lifecycle_options(
    method: Callable[Concatenate[_W, _P], _R],
) -> Callable[Concatenate[_W, _P], _R]:
    """Give a worker method the keyword-only lifecycle options it declares:
    ``wake_first: bool | Iterable[Part] = False`` (``wake_up()`` before the work, of
    every part with ``True`` or of the given parts; idempotent) and
    ``sleep_after: Iterable[Part] | None = None`` (``sleep(parts=sleep_after)`` after the
    work succeeded; not when it raised). The wrapper consumes both (the method body
    never sees them) and records the call's timeline (``last_timeline()``)."""
    declared = inspect.signature(method).parameters
    for name in ("wake_first", "sleep_after"):
        if name not in declared or declared[name].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"{method.__qualname__} must declare the keyword-only {name!r}")

    @functools.wraps(method)
    def wrapper(self: _W, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        wake_first = cast("bool | Iterable[Part]", kwargs.pop("wake_first", False))
        sleep_after = cast("Iterable[Part] | None", kwargs.pop("sleep_after", None))
        return self._with_lifecycle(
            method.__name__,
            partial(method, self, *args, **kwargs),
            wake_first=wake_first,
            sleep_after=sleep_after,
        )

    return wrapper
