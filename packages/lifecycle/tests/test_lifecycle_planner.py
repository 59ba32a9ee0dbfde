"""ResidencyPlanner: the driver's residency state over the pure plan_transitions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ppo_lifecycle import (
    ALL_PARTS,
    KEEP_GRADIENTS,
    Action,
    CallPlan,
    Part,
    Phase,
    PlanStep,
    ResidencyLedger,
    ResidencyPlanner,
    Role,
    Transition,
    Work,
    plan_transitions,
)
from ppo_lifecycle._plan import _NEEDS

V, PF, PB = Phase.VALUE_FORWARD, Phase.POLICY_FORWARD, Phase.POLICY_BACKWARD
UPD, REFIT, CT, SAVE, W = (
    Phase.POLICY_UPDATE,
    Phase.REFIT,
    Phase.CRITIC_TRAIN,
    Phase.CHECKPOINT_SAVE,
    Phase.WAIT,
)
A, C = Role.ACTOR, Role.CRITIC


def _plan(before: tuple[Transition, ...], wake: bool, sleep: frozenset[Part] | None) -> CallPlan:
    return CallPlan(before=before, wake_first=wake, sleep_after=sleep)


def test_streaming_step_with_two_chunks() -> None:
    """What the pump does, one worker call per model per chunk, critic resident at start."""
    p = ResidencyPlanner(resident=C)
    # chunk 1
    assert p.call(C, V, then=(PB,)) == _plan((), False, ALL_PARTS)
    assert (p.resident, p.switches) == (None, 0)
    assert p.call(A, PB, then=(W, V)) == _plan((), True, KEEP_GRADIENTS)
    assert (p.resident, p.pending_gradients, p.switches) == (None, True, 1)
    assert p.before(W, V) == [Transition(C, Action.WAKE_UP)]  # critic ready before waiting
    assert p.before(W, V) == []  # an empty selection: nothing moves
    assert (p.resident, p.switches) == (C, 2)
    # chunk 2, the last: the actor stays for the update
    assert p.call(C, V, then=(PB,)) == _plan((), False, ALL_PARTS)
    assert p.call(A, PB, then=(UPD,)) == _plan((), True, None)
    assert p.call(A, UPD, then=(REFIT,)) == _plan((), False, None)
    assert not p.pending_gradients
    assert p.call(A, REFIT, then=(CT,)) == _plan((), False, ALL_PARTS)
    assert p.call(C, CT) == _plan((), True, None)
    assert (p.resident, p.pending_gradients, p.switches) == (C, False, 4)
    assert [str(s) for s in p.checkpoint()] == [
        "checkpoint_save@critic",
        "critic.sleep(all)",
        "actor.wake_up",
        "checkpoint_save@actor",
        "actor.sleep(all)",
        "critic.wake_up",
    ]
    assert (p.resident, p.switches) == (C, 6)


def test_full_batch_step_matches_the_plan_table() -> None:
    p = ResidencyPlanner(resident=C)
    assert p.call(C, V, then=(PF,)) == _plan((), False, ALL_PARTS)
    assert p.call(A, PF, then=(PB,)) == _plan((), True, None)
    assert p.call(A, PB, then=(UPD,)) == _plan((), False, None)
    assert p.call(A, UPD) == _plan((), False, None)  # no look-ahead: stays resident
    assert p.call(A, REFIT) == _plan((), False, None)
    # The critic's call carries the actor's sleep that no earlier call did.
    assert p.call(C, CT) == _plan((Transition(A, Action.SLEEP, ALL_PARTS),), True, None)
    assert p.resident is C


def test_leftover_sleep_keeps_gradients_and_cold_start() -> None:
    p = ResidencyPlanner(resident=A, pending_gradients=True)
    assert p.call(C, V) == _plan((Transition(A, Action.SLEEP, KEEP_GRADIENTS),), True, None)
    cold = ResidencyPlanner()
    assert (cold.resident, cold.pending_gradients, cold.switches) == (None, False, 0)
    assert cold.before(W, V) == [Transition(C, Action.WAKE_UP)]
    assert cold.before(W) == []  # nothing after the wait: nothing prepared
    assert ResidencyPlanner().before(W) == []


def test_then_takes_only_the_callers_sleeps() -> None:
    p = ResidencyPlanner(resident=C)
    plan = p.call(C, V, then=(W, PB))  # the actor's wake-up is left for its own call
    assert plan.sleep_after == ALL_PARTS and p.resident is None and p.switches == 0
    assert p.before(W, PB) == [Transition(A, Action.WAKE_UP)]
    assert p.call(A, PB, then=(PB,)) == _plan((), False, None)  # same role next: stays


def test_errors_change_nothing() -> None:
    p = ResidencyPlanner(resident=A, pending_gradients=True)
    state = p.state_dict()
    with pytest.raises(ValueError, match="checkpoint_save while the actor"):
        p.checkpoint()
    with pytest.raises(ValueError, match="checkpoint_save while the actor"):
        p.call(A, PB, then=(W, SAVE))
    with pytest.raises(ValueError, match=r"call\(actor, value_forward\): .* done by the critic"):
        p.call(A, V)
    with pytest.raises(ValueError, match="needs no worker call"):
        p.call(C, W)
    with pytest.raises(ValueError, match="use checkpoint"):
        p.call(C, SAVE)
    with pytest.raises(ValueError, match="use checkpoint"):
        p.before(SAVE)
    with pytest.raises(ValueError, match="at least one phase"):
        p.before()
    with pytest.raises(ValueError, match=r"then\[1\]: 'nap' is not a Phase"):
        p.call(A, UPD, then=(W, "nap"))  # type: ignore[arg-type]
    assert p.state_dict() == state


def test_state_dict_round_trip_and_validation() -> None:
    p = ResidencyPlanner(resident=C)
    p.call(C, V, then=(PB,))
    p.call(A, PB, then=(W, V))
    state = p.state_dict()
    assert state == {"resident": None, "pending_gradients": True, "switches": 1}
    q = ResidencyPlanner()
    q.load_state_dict(state)
    assert q.state_dict() == state
    assert q.before(W, V) == p.before(W, V)
    q.load_state_dict({"resident": "actor", "pending_gradients": False, "switches": 3})
    assert q.resident is A and q.switches == 3
    bad_states: list[tuple[dict[str, object], str]] = [
        ({"resident": "critic"}, "keys"),
        ({"resident": "judge", "pending_gradients": False, "switches": 0}, "not a Role"),
        ({"resident": None, "pending_gradients": 1, "switches": 0}, "not a bool"),
        ({"resident": None, "pending_gradients": False, "switches": -1}, "not an int"),
    ]
    for bad, match in bad_states:
        with pytest.raises(ValueError, match=match):
            q.load_state_dict(bad)
    assert q.resident is A  # unchanged


# ------------------------------------------------------------------ property


def _drive(phases: list[Phase], planner: ResidencyPlanner, cuts: list[int]) -> list[PlanStep]:
    """Run ``phases`` as the pump would, flattening what the planner hands out."""
    out: list[PlanStep] = []
    for i, phase in enumerate(phases):
        rest = phases[i + 1 :]
        if phase is W:
            out.extend(planner.before(W, *rest))
            out.append(Work(W, None))
        elif phase is SAVE:
            out.extend(planner.checkpoint(end_resident=None))
        else:
            role = _NEEDS[phase]
            then = rest[: max(1, cuts[i % len(cuts)])] if rest else ()
            plan = planner.call(role, phase, then=then)
            out.extend(plan.before)
            if plan.wake_first:
                out.append(Transition(role, Action.WAKE_UP))
            out.append(Work(phase, role))
            if plan.sleep_after is not None:
                out.append(Transition(role, Action.SLEEP, plan.sleep_after))
    return out


@given(
    st.lists(st.sampled_from(list(Phase)), max_size=25),
    st.sampled_from([None, A, C]),
    st.booleans(),
    st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=5),
)
def test_executing_the_planner_matches_the_plan(
    phases: list[Phase], resident: Role | None, pending: bool, cuts: list[int]
) -> None:
    planner = ResidencyPlanner(resident=resident, pending_gradients=pending)
    try:
        expected = plan_transitions(
            phases, resident=resident, pending_gradients=pending, end_resident=None
        )
    except ValueError:  # a checkpoint inside an update: refused on the way, too
        with pytest.raises(ValueError, match="checkpoint_save while the actor"):
            _drive(phases, planner, cuts)
        return
    executed = _drive(phases, planner, cuts)
    # The same transitions and work, in the same order, as the pure plan.
    assert executed == expected
    # Replayed step by step: never two resident models, work only on a resident one,
    # no redundant transition, and the planner's state is what the replay ends in.
    awake = {A: resident is A, C: resident is C}
    ledger = ResidencyLedger()
    for role in Role:
        ledger.register(
            role,
            device="cpu",
            part_bytes={p: 10 for p in ALL_PARTS},
            resident=ALL_PARTS if awake[role] else (),
        )
    for step in executed:
        ledger.apply(step)  # raises if both were ever resident
        if isinstance(step, Transition):
            assert awake[step.role] is (step.action is Action.SLEEP), step
            awake[step.role] = step.action is Action.WAKE_UP
            assert sum(awake.values()) <= 1
        elif step.role is not None:
            assert awake[step.role], step
    assert planner.resident == next((r for r, up in awake.items() if up), None)
    wakes = [s for s in executed if isinstance(s, Transition) and s.action is Action.WAKE_UP]
    assert planner.switches == len(wakes)
    backward = [i for i, p in enumerate(phases) if p is PB]
    update = [i for i, p in enumerate(phases) if p is UPD]
    last_b, last_u = max(backward, default=-1), max(update, default=-1)
    assert planner.pending_gradients is (last_b > last_u if (backward or update) else pending)
