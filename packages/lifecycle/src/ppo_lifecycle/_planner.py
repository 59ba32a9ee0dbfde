"""The driver's residency state, built on the pure :func:`plan_transitions`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ._parts import ALL_PARTS, Part, normalize_parts
from ._plan import (
    _NEEDS,
    Action,
    Phase,
    PlanStep,
    Role,
    Transition,
    Work,
    _start_state,
    plan_transitions,
)

__all__ = ["CallPlan", "ResidencyPlanner"]


@dataclass(frozen=True)
class CallPlan:
    """The lifecycle choice one worker call carries (see :meth:`ResidencyPlanner.call`).

    Attributes:
        before: transitions to run as their own calls, in order, before the call
            (normally empty: an earlier call already carried them).
        wake_first: the call wakes its role up before the work.
        wake_parts: the parts that wake-up brings back (what the phase needs, e.g.
            ``FORWARD_PARTS`` for a value forward); ``ALL_PARTS`` without ``wake_first``.
        sleep_after: the call puts its role to sleep with these parts after the
            work; ``None``: it stays resident.
    """

    before: tuple[Transition, ...]
    wake_first: bool
    sleep_after: frozenset[Part] | None
    wake_parts: frozenset[Part] = ALL_PARTS


def _leading(plan: Sequence[PlanStep]) -> list[Transition]:
    """The transitions of ``plan`` before its first ``Work`` item."""
    out: list[Transition] = []
    for item in plan:
        if isinstance(item, Work):
            break
        out.append(item)
    return out


@dataclass
class _State:
    resident: Role | None
    pending_gradients: bool
    switches: int
    parts: frozenset[Part] = ALL_PARTS  # of the resident model

    def take(self, item: Transition) -> None:
        """Account for ``item`` as done (a wake-up of more parts of the resident model
        is no switch)."""
        if item.action is Action.WAKE_UP:
            if self.resident is item.role:
                self.parts = self.parts | item.parts
                return
            self.resident, self.parts = item.role, item.parts
            self.switches += 1
        elif self.resident is item.role:
            self.resident, self.parts = None, frozenset()

    def work(self, phase: Phase) -> None:
        """Account for ``phase``'s work as done."""
        if phase is Phase.POLICY_BACKWARD:
            self.pending_gradients = True
        elif phase is Phase.POLICY_UPDATE:
            self.pending_gradients = False

    def plan(self, phases: Sequence[Phase], end_resident: Role | None = None) -> list[PlanStep]:
        return plan_transitions(
            phases,
            resident=self.resident,
            pending_gradients=self.pending_gradients,
            end_resident=end_resident,
            resident_parts=self.parts if self.resident is not None else ALL_PARTS,
        )


def _state(
    resident: Role | str | None, pending: bool, switches: int, parts: Iterable[Part]
) -> _State:
    """A consistent state (see :func:`~ppo_lifecycle._plan._start_state`)."""
    role, chosen = _start_state(resident, parts, pending=pending)
    return _State(role, pending, switches, chosen)


def _phases(phases: Sequence[Phase], what: str) -> list[Phase]:
    """``phases`` as :class:`Phase` members (``ValueError`` naming ``what`` otherwise)."""
    out: list[Phase] = []
    for index, raw in enumerate(phases):
        try:
            out.append(Phase(raw))
        except ValueError:
            valid = ", ".join(p.value for p in Phase)
            raise ValueError(
                f"{what}[{index}]: {raw!r} is not a Phase; use one of {valid}"
            ) from None
    return out


class ResidencyPlanner:
    """Which model holds the training devices, and the transitions each call needs.

    The driver's single copy of the residency state: it asks, before each piece of
    work, what the pure :func:`plan_transitions` puts before it, and the planner
    takes those transitions as done (the caller runs them: as their own traced
    calls, or fused into the worker call as ``wake_first`` / ``sleep_after``).
    Concatenating everything it hands out, in order, gives exactly the transitions
    of ``plan_transitions`` over the same phases (with ``end_resident=None``), so at
    most one model is resident at any time and no switch is redundant.

    Every method either returns and updates the state, or raises and changes nothing.

    Args:
        resident: the model resident now (the other is fully asleep); ``None``:
            neither (the actor may still hold kept gradients).
        pending_gradients: the actor holds gradients accumulated since its last
            ``POLICY_UPDATE`` (it then sleeps with ``KEEP_GRADIENTS``).
        resident_parts: the parts of ``resident`` on the device (default: all).
    """

    def __init__(
        self,
        *,
        resident: Role | None = None,
        pending_gradients: bool = False,
        resident_parts: frozenset[Part] = ALL_PARTS,
    ) -> None:
        self._state = _state(resident, bool(pending_gradients), 0, resident_parts)

    # ----------------------------------------------------------------- state
    @property
    def resident(self) -> Role | None:
        """The model fully resident now, or ``None``."""
        return self._state.resident

    @property
    def resident_parts(self) -> frozenset[Part]:
        """The parts of :attr:`resident` on the device (empty while none is)."""
        return self._state.parts if self._state.resident is not None else frozenset()

    @property
    def pending_gradients(self) -> bool:
        """Whether the actor holds gradients not yet applied by a ``POLICY_UPDATE``."""
        return self._state.pending_gradients

    @property
    def switches(self) -> int:
        """Wake-ups handed out so far (in ``before`` lists, calls and checkpoints)."""
        return self._state.switches

    def __repr__(self) -> str:
        return (
            f"ResidencyPlanner(resident={self.resident}, "
            f"resident_parts={sorted(p.value for p in self.resident_parts)}, "
            f"pending_gradients={self.pending_gradients}, switches={self.switches})"
        )

    def _trial(self) -> _State:
        s = self._state
        return _State(s.resident, s.pending_gradients, s.switches, s.parts)

    # ------------------------------------------------------------------ plans
    def before(self, *phases: Phase) -> list[Transition]:
        """The transitions to run before ``phases[0]``'s work, taken as done.

        Only ``phases[0]``'s work follows; later phases say what a ``WAIT`` prepares
        for (``before(Phase.WAIT, Phase.VALUE_FORWARD)`` wakes the critic before
        waiting). The planner then accounts for ``phases[0]``'s work
        (``POLICY_BACKWARD``: gradients pending; ``POLICY_UPDATE``: none).

        Raises:
            ValueError: no phase, or one that is not a :class:`Phase`, or
                ``CHECKPOINT_SAVE`` (use :meth:`checkpoint`).
        """
        chosen = _phases(phases, "phases")
        if not chosen:
            raise ValueError("before(): pass at least one phase (the one whose work follows)")
        if chosen[0] is Phase.CHECKPOINT_SAVE:
            raise ValueError("before(checkpoint_save): use checkpoint(), which saves both models")
        trial = self._trial()
        out = _leading(trial.plan(chosen))
        for item in out:
            trial.take(item)
        trial.work(chosen[0])
        self._state = trial
        return out

    def call(self, role: Role, phase: Phase, *, then: Sequence[Phase] = ()) -> CallPlan:
        """The lifecycle choice of one worker call of ``role`` doing ``phase``.

        The transitions before ``phase`` that wake ``role`` become ``wake_first``;
        any other leading ones (the other model's sleep that no earlier call
        carried) are returned in ``before``, to run first as their own calls. Then
        ``phase``'s work is accounted for. When ``then`` is given, the transitions
        before ``then[0]`` (``then[1:]``: look-ahead past a ``WAIT``) are planned and
        only the leading sleeps of ``role`` are taken, as ``sleep_after``; the other
        model's wake-up is left for its own next call (or :meth:`before`), so the
        planner's ``resident`` is ``None`` in between.

        Raises:
            ValueError: ``phase`` is not done by ``role`` (``WAIT`` and
                ``CHECKPOINT_SAVE`` are no worker call here), or ``then`` names
                something that is not a :class:`Phase`, or plans a checkpoint inside
                an update.
        """
        who = Role(role)
        (work,) = _phases([phase], "phase")
        following = _phases(then, "then")
        needs = _NEEDS.get(work)
        if needs is not who:
            done_by = f"is done by the {needs}" if needs is not None else "needs no worker call"
            hint = " (use checkpoint())" if work is Phase.CHECKPOINT_SAVE else ""
            raise ValueError(f"call({who}, {work}): {work} {done_by}{hint}")
        trial = self._trial()
        lead = _leading(trial.plan([work]))
        wake_first = bool(lead) and lead[-1].role is who and lead[-1].action is Action.WAKE_UP
        wake_parts = lead[-1].parts if wake_first else ALL_PARTS
        before = tuple(lead[:-1] if wake_first else lead)
        for item in lead:
            trial.take(item)
        trial.work(work)
        sleep_after: frozenset[Part] | None = None
        if following:
            for item in _leading(trial.plan(following)):
                if item.role is not who or item.action is not Action.SLEEP:
                    break
                sleep_after = item.parts if sleep_after is None else sleep_after | item.parts
                trial.take(item)
        self._state = trial
        return CallPlan(
            before=before, wake_first=wake_first, sleep_after=sleep_after, wake_parts=wake_parts
        )

    def checkpoint(self, *, end_resident: Role | None = Role.CRITIC) -> list[PlanStep]:
        """The ``CHECKPOINT_SAVE`` plan, taken as done: transitions and one
        ``Work(CHECKPOINT_SAVE, role)`` per model, the resident one saved first, then
        ``end_resident`` made resident (``None``: leave the last one saved resident).

        Raises:
            ValueError: the actor holds un-applied gradients (inside an update).
        """
        end = None if end_resident is None else Role(end_resident)
        trial = self._trial()
        plan = trial.plan([Phase.CHECKPOINT_SAVE], end)
        for item in plan:
            if isinstance(item, Transition):
                trial.take(item)
        self._state = trial
        return plan

    def release_all(self) -> list[Transition]:
        """The transitions that leave no model resident (the resident one sleeps with all
        its parts), taken as done: the devices are then free for other work, e.g.
        colocated generation. ``[]`` when none is resident.

        Raises:
            ValueError: the actor holds un-applied gradients (inside an update).
        """
        if self._state.pending_gradients:
            raise ValueError("release_all() inside an update: the actor's gradients are pending")
        trial = self._trial()
        if trial.resident is None:
            return []
        out = [Transition(trial.resident, Action.SLEEP, ALL_PARTS)]
        trial.take(out[0])
        self._state = trial
        return out

    # ------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, object]:
        """JSON-friendly state: ``resident`` (``"actor"``, ``"critic"`` or ``None``),
        ``resident_parts`` (its parts on the device, sorted names), ``pending_gradients``,
        ``switches``."""
        s = self._state
        return {
            "resident": None if s.resident is None else s.resident.value,
            "resident_parts": sorted(p.value for p in self.resident_parts),
            "pending_gradients": s.pending_gradients,
            "switches": s.switches,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore what :meth:`state_dict` returned (a state from ppo-lifecycle 0.2,
        without ``resident_parts``, means the resident model is fully resident).

        Raises:
            ValueError: a key is missing or unknown, or a value has the wrong type.
        """
        required = {"resident", "pending_gradients", "switches"}
        allowed = required | {"resident_parts"}
        if not required <= set(state) <= allowed:
            raise ValueError(
                f"ResidencyPlanner state: keys {sorted(state)}; expected {sorted(allowed)} "
                "(resident_parts optional)"
            )
        resident, pending, switches = (
            state["resident"],
            state["pending_gradients"],
            state["switches"],
        )
        if resident is not None and resident not in {r.value for r in Role}:
            raise ValueError(f"ResidencyPlanner state: resident={resident!r} is not a Role")
        if not isinstance(pending, bool):
            raise ValueError(f"ResidencyPlanner state: pending_gradients={pending!r} is not a bool")
        if isinstance(switches, bool) or not isinstance(switches, int) or switches < 0:
            raise ValueError(f"ResidencyPlanner state: switches={switches!r} is not an int >= 0")
        raw_parts = state.get("resident_parts", [p.value for p in ALL_PARTS])
        parts: frozenset[Part] = frozenset()
        if resident is not None:
            try:
                parts = normalize_parts(raw_parts)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ValueError(
                    f"ResidencyPlanner state: resident_parts={raw_parts!r} is not a non-empty "
                    "list of part names"
                ) from None
        self._state = _state(
            None if resident is None else Role(str(resident)), pending, switches, parts
        )
