"""The driver-facing plan: which model is resident for each phase of a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from ._parts import ALL_PARTS, KEEP_GRADIENTS, Part

__all__ = ["Action", "Phase", "PlanStep", "Role", "Transition", "Work", "plan_transitions"]


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


class Action(StrEnum):
    SLEEP = "sleep"
    WAKE_UP = "wake_up"


@dataclass(frozen=True)
class Transition:
    """Call ``role``'s ``sleep(parts=parts)`` or ``wake_up()`` (then ``parts`` is all)."""

    role: Role
    action: Action
    parts: frozenset[Part] = ALL_PARTS

    def __str__(self) -> str:
        if self.action is Action.WAKE_UP:
            return f"{self.role}.wake_up"
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


def plan_transitions(
    phases: Sequence[Phase],
    *,
    resident: Role | None = Role.CRITIC,
    pending_gradients: bool = False,
    end_resident: Role | None = Role.CRITIC,
) -> list[PlanStep]:
    """The schedule of one step: its phases with the wake/sleep transitions between.

    Pure function. At most one model is resident at any time; a model switches
    only when the next phase needs the other one (no redundant switch). Before a
    ``WAIT`` the model needed after it is prepared, so it stays resident across any
    number of empty selections. The actor sleeps with ``KEEP_GRADIENTS`` while it
    holds gradients accumulated since its last ``POLICY_UPDATE``, else with all parts.
    ``CHECKPOINT_SAVE`` saves both models, the resident one first.

    Args:
        phases: the step's phases in order, e.g. per chunk
            ``[VALUE_FORWARD, POLICY_FORWARD, POLICY_BACKWARD, WAIT]``, then
            ``[POLICY_UPDATE, REFIT, CRITIC_TRAIN, CHECKPOINT_SAVE]``.
        resident: the model resident when the step starts (the other is fully asleep).
        pending_gradients: the actor starts the step holding un-applied gradients.
        end_resident: the model to leave resident at the end (the next step starts
            with a value forward, so by default the critic); ``None``: leave as is.

    Returns:
        ``Transition`` and ``Work`` items in execution order.

    Raises:
        ValueError: a phase is not a :class:`Phase`, or ``CHECKPOINT_SAVE`` comes
            while the actor holds un-applied gradients (inside an update).
    """
    state: Role | None = resident
    pending = pending_gradients
    out: list[PlanStep] = []

    def switch(to: Role) -> None:
        nonlocal state
        if state is to:
            return
        if state is not None:
            parts = KEEP_GRADIENTS if state is Role.ACTOR and pending else ALL_PARTS
            out.append(Transition(state, Action.SLEEP, parts))
        out.append(Transition(to, Action.WAKE_UP))
        state = to

    for index, raw in enumerate(phases):
        try:
            phase = Phase(raw)
        except ValueError:
            valid = ", ".join(p.value for p in Phase)
            raise ValueError(
                f"phases[{index}]: {raw!r} is not a Phase; use one of {valid}"
            ) from None
        if phase is Phase.WAIT:
            upcoming = next(
                (_NEEDS[p] for p in map(Phase, phases[index + 1 :]) if p in _NEEDS), None
            )
            if upcoming is None and any(
                Phase(p) is Phase.CHECKPOINT_SAVE for p in phases[index + 1 :]
            ):
                upcoming = state
            target = upcoming if upcoming is not None else end_resident
            if target is not None:
                switch(target)
            out.append(Work(phase, None))
            continue
        if phase is Phase.CHECKPOINT_SAVE:
            if pending:
                raise ValueError(
                    f"phases[{index}]: checkpoint_save while the actor holds un-applied "
                    "gradients; checkpoints must exclude the whole update: save after "
                    "policy_update"
                )
            first = state if state is not None else Role.CRITIC
            for role in (first, _other(first)):
                switch(role)
                out.append(Work(phase, role))
            continue
        role = _NEEDS[phase]
        switch(role)
        out.append(Work(phase, role))
        if phase is Phase.POLICY_BACKWARD:
            pending = True
        elif phase is Phase.POLICY_UPDATE:
            pending = False
    if end_resident is not None:
        switch(end_resident)
    return out
