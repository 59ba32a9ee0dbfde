"""The driver-facing plan: which model is resident for each phase of a step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from ._parts import (
    ALL_PARTS,
    BACKWARD_PARTS,
    FORWARD_PARTS,
    KEEP_GRADIENTS,
    Part,
    normalize_parts,
    parts_label,
)

__all__ = [
    "Action",
    "Phase",
    "PlanStep",
    "Role",
    "Transition",
    "Work",
    "phase_parts",
    "plan_transitions",
]


class Role(StrEnum):
    """The two models that time-share the training devices."""

    ACTOR = "actor"
    CRITIC = "critic"


class Phase(StrEnum):
    """One piece of work in a training step, in the driver's order.

    ``WAIT`` is the driver waiting for the sampler (the next chunk, or an empty
    selection); it needs no model, and the plan prepares the next one before it.
    """

    VALUE_FORWARD = "value_forward"
    POLICY_FORWARD = "policy_forward"
    POLICY_BACKWARD = "policy_backward"
    POLICY_UPDATE = "policy_update"
    REFIT = "refit"
    CRITIC_TRAIN = "critic_train"
    CHECKPOINT_SAVE = "checkpoint_save"
    WAIT = "wait"


_NEEDS: dict[Phase, Role] = {
    Phase.VALUE_FORWARD: Role.CRITIC,
    Phase.POLICY_FORWARD: Role.ACTOR,
    Phase.POLICY_BACKWARD: Role.ACTOR,
    Phase.POLICY_UPDATE: Role.ACTOR,
    Phase.REFIT: Role.ACTOR,
    Phase.CRITIC_TRAIN: Role.CRITIC,
}

#: What each phase needs resident (the rest of its model may stay asleep).
_PARTS: dict[Phase, frozenset[Part]] = {
    Phase.VALUE_FORWARD: FORWARD_PARTS,
    Phase.POLICY_FORWARD: FORWARD_PARTS,
    Phase.POLICY_BACKWARD: BACKWARD_PARTS,
    Phase.POLICY_UPDATE: ALL_PARTS,
    Phase.REFIT: FORWARD_PARTS,
    Phase.CRITIC_TRAIN: ALL_PARTS,
    Phase.CHECKPOINT_SAVE: ALL_PARTS,
}


def phase_parts(phase: Phase) -> frozenset[Part]:
    """The parts ``phase``'s work needs on the device: ``FORWARD_PARTS`` for a value or
    log-prob forward and a refit, ``BACKWARD_PARTS`` for a policy backward, all parts
    for an optimizer update, critic training and a checkpoint (none for ``WAIT``)."""
    return _PARTS.get(Phase(phase), frozenset())


class Action(StrEnum):
    SLEEP = "sleep"
    WAKE_UP = "wake_up"


@dataclass(frozen=True)
class Transition:
    """Call ``role``'s ``sleep(parts=parts)`` (the parts that are off the device after
    it) or ``wake_up(parts=parts)`` (the parts brought back; the rest stay asleep)."""

    role: Role
    action: Action
    parts: frozenset[Part] = ALL_PARTS

    def __str__(self) -> str:
        """``actor.sleep(keep_grads)``, ``critic.sleep(all)``, ``critic.wake_up`` (all
        parts), ``critic.wake_up(parameters+buffers)``, ``actor.wake_up(optimizer)``."""
        if self.action is Action.WAKE_UP:
            if self.parts == ALL_PARTS:
                return f"{self.role}.wake_up"
            return f"{self.role}.wake_up({parts_label(self.parts)})"
        keep = "keep_grads" if self.parts == KEEP_GRADIENTS else "all"
        return f"{self.role}.sleep({keep})"


@dataclass(frozen=True)
class Work:
    """Run ``phase`` on ``role`` (``None`` for ``WAIT``)."""

    phase: Phase
    role: Role | None

    def __str__(self) -> str:
        return f"{self.phase}" if self.role is None else f"{self.phase}@{self.role}"


PlanStep = Transition | Work


def _other(role: Role) -> Role:
    return Role.CRITIC if role is Role.ACTOR else Role.ACTOR


def _start_state(
    resident: Role | str | None, parts: Iterable[Part], *, pending: bool
) -> tuple[Role | None, frozenset[Part]]:
    """``(resident, its parts on the device)``, made consistent: while the actor holds
    pending gradients they count as resident (kept), and an actor holding nothing else
    is not resident. Shared by :func:`plan_transitions` and the planner's state."""
    role = None if resident is None else Role(resident)
    chosen = normalize_parts(parts) if role is not None else frozenset()
    if role is Role.ACTOR and pending:
        chosen = chosen | {Part.GRADIENTS}
        if chosen == {Part.GRADIENTS}:  # only its kept gradients: asleep, in effect
            role, chosen = None, frozenset()
    return role, chosen


def plan_transitions(
    phases: Sequence[Phase],
    *,
    resident: Role | None = Role.CRITIC,
    pending_gradients: bool = False,
    end_resident: Role | None = Role.CRITIC,
    resident_parts: Iterable[Part] = ALL_PARTS,
) -> list[PlanStep]:
    """The schedule of one step: its phases with the wake/sleep transitions between.

    Pure function. At most one model is resident at any time (the actor's kept
    gradients aside); a model switches only when the next phase needs the other one
    (no redundant switch). A wake-up brings back only what the phase needs
    (:func:`phase_parts`: a forward leaves the optimizer state asleep); a later phase
    of the same model that needs more wakes just the missing parts. Before a ``WAIT``
    the model needed after it is prepared, so it stays resident across any number of
    empty selections. The actor sleeps with ``KEEP_GRADIENTS`` while it holds
    gradients accumulated since its last ``POLICY_UPDATE``, else with all parts.
    ``CHECKPOINT_SAVE`` saves both models, the resident one first (with neither
    resident: the one other than ``end_resident`` first, so the model saved last is the
    one left resident; the critic first when ``end_resident`` is ``None``).

    Args:
        phases: the step's phases in order, e.g. per chunk
            ``[VALUE_FORWARD, POLICY_FORWARD, POLICY_BACKWARD, WAIT]``, then
            ``[POLICY_UPDATE, REFIT, CRITIC_TRAIN, CHECKPOINT_SAVE]``.
        resident: the model resident when the step starts (the other is fully asleep).
        pending_gradients: the actor starts the step holding un-applied gradients.
        end_resident: the model to leave resident at the end, with the parts a forward
            needs (the next step starts with a value forward, so by default the
            critic); ``None``: leave as is.
        resident_parts: the parts of ``resident`` on the device (default: all).

    Returns:
        ``Transition`` and ``Work`` items in execution order.

    Raises:
        ValueError: a phase is not a :class:`Phase`, or ``CHECKPOINT_SAVE`` comes
            while the actor holds un-applied gradients (inside an update), or
            ``resident_parts`` is empty or not made of :class:`Part`.
    """
    pending = pending_gradients
    state, awake = _start_state(resident, resident_parts, pending=pending)
    out: list[PlanStep] = []

    def switch(to: Role, needed: frozenset[Part]) -> None:
        nonlocal state, awake
        if to is Role.ACTOR and pending:
            needed = needed | {Part.GRADIENTS}  # kept on the device while it sleeps
        if state is to:
            missing = needed - awake
            if missing:
                out.append(Transition(to, Action.WAKE_UP, missing))
                awake = awake | missing
            return
        if state is not None:
            parts = KEEP_GRADIENTS if state is Role.ACTOR and pending else ALL_PARTS
            out.append(Transition(state, Action.SLEEP, parts))
        out.append(Transition(to, Action.WAKE_UP, needed))
        state, awake = to, needed

    for index, raw in enumerate(phases):
        try:
            phase = Phase(raw)
        except ValueError:
            valid = ", ".join(p.value for p in Phase)
            raise ValueError(
                f"phases[{index}]: {raw!r} is not a Phase; use one of {valid}"
            ) from None
        if phase is Phase.WAIT:
            upcoming = next((Phase(p) for p in phases[index + 1 :] if Phase(p) in _NEEDS), None)
            if upcoming is not None:
                switch(_NEEDS[upcoming], _PARTS[upcoming])
            elif state is not None and any(
                Phase(p) is Phase.CHECKPOINT_SAVE for p in phases[index + 1 :]
            ):
                pass  # the checkpoint starts with the model already resident
            elif end_resident is not None:
                switch(end_resident, FORWARD_PARTS)
            out.append(Work(phase, None))
            continue
        if phase is Phase.CHECKPOINT_SAVE:
            if pending:
                raise ValueError(
                    f"phases[{index}]: checkpoint_save while the actor holds un-applied "
                    "gradients; checkpoints must exclude the whole update: save after "
                    "policy_update"
                )
            if state is not None:
                first = state
            else:  # the last one saved stays: no extra switch to reach end_resident
                first = Role.CRITIC if end_resident is None else _other(end_resident)
            for role in (first, _other(first)):
                switch(role, ALL_PARTS)
                out.append(Work(phase, role))
            continue
        role = _NEEDS[phase]
        switch(role, _PARTS[phase])
        out.append(Work(phase, role))
        if phase is Phase.POLICY_BACKWARD:
            pending = True
        elif phase is Phase.POLICY_UPDATE:
            pending = False
    if end_resident is not None:
        switch(end_resident, FORWARD_PARTS)
    return out
