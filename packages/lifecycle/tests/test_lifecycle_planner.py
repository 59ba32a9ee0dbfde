"""ResidencyPlanner: the driver's residency state over the pure plan_transitions."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from ppo_lifecycle import (
    ALL_PARTS,
    BACKWARD_PARTS,
    FORWARD_PARTS,
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
    phase_parts,
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
OPTIMIZER, GRADIENTS = frozenset({Part.OPTIMIZER}), frozenset({Part.GRADIENTS})


def _plan(
    before: tuple[Transition, ...],
    wake: bool,
    sleep: frozenset[Part] | None,
    wake_parts: frozenset[Part] = ALL_PARTS,
) -> CallPlan:
    return CallPlan(before=before, wake_first=wake, sleep_after=sleep, wake_parts=wake_parts)


def test_streaming_step_with_two_chunks() -> None:
    """What the pump does, one worker call per model per chunk, critic resident at start."""
    p = ResidencyPlanner(resident=C)
    # chunk 1
    assert p.call(C, V, then=(PB,)) == _plan((), False, ALL_PARTS)
    assert (p.resident, p.resident_parts, p.switches) == (None, frozenset(), 0)
    assert p.call(A, PB, then=(W, V)) == _plan((), True, KEEP_GRADIENTS, BACKWARD_PARTS)
    assert (p.resident, p.pending_gradients, p.switches) == (None, True, 1)
    # critic ready for a forward before waiting
    assert p.before(W, V) == [Transition(C, Action.WAKE_UP, FORWARD_PARTS)]
    assert p.before(W, V) == []  # an empty selection: nothing moves
    assert (p.resident, p.resident_parts, p.switches) == (C, FORWARD_PARTS, 2)
    # chunk 2, the last: the actor stays for the update, which brings the optimizer back
    assert p.call(C, V, then=(PB,)) == _plan((), False, ALL_PARTS)
    assert p.call(A, PB, then=(UPD,)) == _plan((), True, None, BACKWARD_PARTS)
    assert p.call(A, UPD, then=(REFIT,)) == _plan((), True, None, OPTIMIZER)
    assert (p.resident, p.resident_parts, p.pending_gradients) == (A, ALL_PARTS, False)
    assert p.switches == 3  # more parts of the resident actor: no switch
    assert p.call(A, REFIT, then=(CT,)) == _plan((), False, ALL_PARTS)
    assert p.call(C, CT) == _plan((), True, None)
    assert (p.resident, p.pending_gradients, p.switches) == (C, False, 4)
    assert [str(s) for s in p.checkpoint()] == [
        "checkpoint_save@critic",
        "critic.sleep(all)",
        "actor.wake_up",
        "checkpoint_save@actor",
        "actor.sleep(all)",
        "critic.wake_up(parameters+buffers)",
    ]
    assert (p.resident, p.resident_parts, p.switches) == (C, FORWARD_PARTS, 6)


def test_full_batch_step_matches_the_plan_table() -> None:
    p = ResidencyPlanner(resident=C)
    assert p.call(C, V, then=(PF,)) == _plan((), False, ALL_PARTS)
    assert p.call(A, PF, then=(PB,)) == _plan((), True, None, FORWARD_PARTS)
    assert p.call(A, PB, then=(UPD,)) == _plan((), True, None, GRADIENTS)
    assert p.call(A, UPD) == _plan((), True, None, OPTIMIZER)  # no look-ahead: stays
    assert p.call(A, REFIT) == _plan((), False, None)
    assert p.switches == 1
    # The critic's call carries the actor's sleep that no earlier call did.
    assert p.call(C, CT) == _plan((Transition(A, Action.SLEEP, ALL_PARTS),), True, None)
    assert (p.resident, p.resident_parts, p.switches) == (C, ALL_PARTS, 2)


def test_call_wakes_only_what_the_phase_needs() -> None:
    cold = ResidencyPlanner()
    assert cold.call(C, V) == _plan((), True, None, FORWARD_PARTS)
    assert (cold.resident, cold.resident_parts, cold.switches) == (C, FORWARD_PARTS, 1)
    # training the critic after its forward wakes the rest of it, no switch
    assert cold.call(C, CT) == _plan((), True, None, frozenset({Part.GRADIENTS, Part.OPTIMIZER}))
    assert (cold.resident_parts, cold.switches) == (ALL_PARTS, 1)
    p = ResidencyPlanner(resident=C)
    sleep_critic = (Transition(C, Action.SLEEP, ALL_PARTS),)
    assert p.call(A, PB) == _plan(sleep_critic, True, None, BACKWARD_PARTS)
    assert (p.resident, p.resident_parts) == (A, BACKWARD_PARTS)
    # the update on an actor resident for a backward only brings the optimizer back
    q = ResidencyPlanner(resident=A, resident_parts=BACKWARD_PARTS, pending_gradients=True)
    assert q.call(A, UPD) == _plan((), True, None, OPTIMIZER)
    assert (q.resident_parts, q.switches, q.pending_gradients) == (ALL_PARTS, 0, False)
    # a phase that needs nothing more: no wake-up at all
    r = ResidencyPlanner(resident=A, resident_parts=FORWARD_PARTS)
    assert r.call(A, REFIT) == _plan((), False, None)
    assert r.resident_parts == FORWARD_PARTS
    with pytest.raises(ValueError, match="parts: empty selection"):
        ResidencyPlanner(resident=C, resident_parts=frozenset())


def test_leftover_sleep_keeps_gradients_and_cold_start() -> None:
    p = ResidencyPlanner(resident=A, pending_gradients=True)
    keep = (Transition(A, Action.SLEEP, KEEP_GRADIENTS),)
    assert p.call(C, V) == _plan(keep, True, None, FORWARD_PARTS)
    cold = ResidencyPlanner()
    assert (cold.resident, cold.pending_gradients, cold.switches) == (None, False, 0)
    assert cold.resident_parts == frozenset()
    assert cold.before(W, V) == [Transition(C, Action.WAKE_UP, FORWARD_PARTS)]
    assert cold.before(W) == []  # nothing after the wait: nothing prepared
    assert ResidencyPlanner().before(W) == []


def test_then_takes_only_the_callers_sleeps() -> None:
    p = ResidencyPlanner(resident=C)
    plan = p.call(C, V, then=(W, PB))  # the actor's wake-up is left for its own call
    assert plan.sleep_after == ALL_PARTS and p.resident is None and p.switches == 0
    assert p.before(W, PB) == [Transition(A, Action.WAKE_UP, BACKWARD_PARTS)]
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
    assert state == {
        "resident": None,
        "resident_parts": [],
        "pending_gradients": True,
        "switches": 1,
    }
    q = ResidencyPlanner()
    q.load_state_dict(state)
    assert q.state_dict() == state
    assert q.before(W, V) == p.before(W, V)
    # Resident for a forward only: the parts survive the round trip.
    state = p.state_dict()
    assert state == {
        "resident": "critic",
        "resident_parts": ["buffers", "parameters"],
        "pending_gradients": True,
        "switches": 2,
    }
    r = ResidencyPlanner()
    r.load_state_dict(state)
    assert (r.resident, r.resident_parts) == (C, FORWARD_PARTS)
    assert r.state_dict() == state
    assert r.call(C, CT) == p.call(C, CT) == _plan((), True, None, ALL_PARTS - FORWARD_PARTS)
    # A ppo-lifecycle 0.2 state (no resident_parts): the resident model is fully resident.
    q.load_state_dict({"resident": "actor", "pending_gradients": False, "switches": 3})
    assert (q.resident, q.resident_parts, q.switches) == (A, ALL_PARTS, 3)
    assert q.state_dict()["resident_parts"] == sorted(part.value for part in Part)
    assert q.call(A, UPD) == _plan((), False, None)
    good = q.state_dict()
    bad_states: list[tuple[dict[str, object], str]] = [
        ({"resident": "critic"}, "keys"),
        ({**good, "parts": ["optimizer"]}, "keys"),
        ({"resident": "judge", "pending_gradients": False, "switches": 0}, "not a Role"),
        ({"resident": None, "pending_gradients": 1, "switches": 0}, "not a bool"),
        ({"resident": None, "pending_gradients": False, "switches": -1}, "not an int"),
        ({**good, "resident_parts": []}, r"resident_parts=\[\] is not a non-empty list"),
        ({**good, "resident_parts": ["weights"]}, r"resident_parts=\['weights'\]"),
    ]
    for bad, match in bad_states:
        with pytest.raises(ValueError, match=match):
            q.load_state_dict(bad)
    assert q.state_dict() == good  # unchanged


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
                out.append(Transition(role, Action.WAKE_UP, plan.wake_parts))
            else:
                assert plan.wake_parts == ALL_PARTS
            out.append(Work(phase, role))
            if plan.sleep_after is not None:
                out.append(Transition(role, Action.SLEEP, plan.sleep_after))
    return out


@given(
    st.lists(st.sampled_from(list(Phase)), max_size=25),
    st.sampled_from([None, A, C]),
    st.booleans(),
    st.frozensets(st.sampled_from(list(Part)), min_size=1),
    st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=5),
)
# found by hypothesis: an actor holding only its kept gradients starts asleep in effect
@example([], A, True, frozenset({Part.GRADIENTS}), [1])
@example([Phase.POLICY_FORWARD], A, True, frozenset({Part.GRADIENTS}), [1])
def test_executing_the_planner_matches_the_plan(
    phases: list[Phase],
    resident: Role | None,
    pending: bool,
    parts: frozenset[Part],
    cuts: list[int],
) -> None:
    # The planner and the pure plan agree from any start, also one where the actor's
    # kept gradients are not named in resident_parts, or are all it holds.
    planner = ResidencyPlanner(resident=resident, pending_gradients=pending, resident_parts=parts)
    try:
        expected = plan_transitions(
            phases,
            resident=resident,
            pending_gradients=pending,
            end_resident=None,
            resident_parts=parts,
        )
    except ValueError:  # a checkpoint inside an update: refused on the way, too
        with pytest.raises(ValueError, match="checkpoint_save while the actor"):
            _drive(phases, planner, cuts)
        return
    executed = _drive(phases, planner, cuts)
    # The same transitions and work, in the same order, as the pure plan.
    assert executed == expected
    # Replayed per part, and on a ledger: each work item finds what its phase needs, at
    # most one model holds more than the actor's kept gradients, no transition is
    # redundant, and the planner's state is what the replay ends in.
    held = {A: frozenset(), C: frozenset()}
    if resident is not None:
        held[resident] = parts
    if pending:
        held[A] |= GRADIENTS
    ledger = ResidencyLedger()
    for role in Role:
        ledger.register(
            role, device="cpu", part_bytes={p: 10 for p in ALL_PARTS}, resident=held[role]
        )
    model, switches, grads = resident, 0, pending
    if resident is A and pending and parts <= GRADIENTS:
        model = None  # holding only its kept gradients, the actor is asleep in effect

    def kept(role: Role) -> frozenset[Part]:
        return GRADIENTS if role is A and grads else frozenset()

    for step in executed:
        ledger.apply(step)  # raises if both were ever resident
        if isinstance(step, Transition):
            keep = kept(step.role)
            if step.action is Action.WAKE_UP:
                assert step.parts - held[step.role], f"redundant {step}"
                switches += step.role is not model  # more parts of the same model: no switch
                model = step.role
                held[step.role] |= step.parts
            else:
                assert held[step.role] - keep, f"redundant {step}"
                model = None
                held[step.role] -= step.parts
            assert sum(1 for r in Role if held[r] - kept(r)) <= 1, f"two resident: {held}"
        elif step.role is not None:
            assert phase_parts(step.phase) <= held[step.role], step
            grads = (grads or step.phase is PB) and step.phase is not UPD
    assert planner.resident is model
    assert planner.resident_parts == (frozenset() if model is None else held[model])
    assert planner.switches == switches
    backward = [i for i, p in enumerate(phases) if p is PB]
    update = [i for i, p in enumerate(phases) if p is UPD]
    last_b, last_u = max(backward, default=-1), max(update, default=-1)
    assert planner.pending_gradients is grads
    assert planner.pending_gradients is (last_b > last_u if (backward or update) else pending)
    # The state survives a round trip.
    copy = ResidencyPlanner()
    copy.load_state_dict(planner.state_dict())
    assert copy.state_dict() == planner.state_dict()
    assert (copy.resident, copy.resident_parts) == (planner.resident, planner.resident_parts)


def test_release_all_leaves_no_model_resident() -> None:
    """``release_all``: the resident model sleeps with all its parts (taken as done),
    nothing when none is resident, refused while the actor's gradients are pending."""
    planner = ResidencyPlanner(resident=Role.CRITIC)
    assert planner.release_all() == [Transition(Role.CRITIC, Action.SLEEP, ALL_PARTS)]
    assert planner.resident is None and planner.resident_parts == frozenset()
    assert planner.release_all() == []
    planner.before(Phase.POLICY_BACKWARD)  # the actor wakes and accumulates gradients
    with pytest.raises(ValueError, match="pending"):
        planner.release_all()
    assert planner.resident is Role.ACTOR
