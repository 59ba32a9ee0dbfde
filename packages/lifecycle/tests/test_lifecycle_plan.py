"""The driver's plan as a table, plus properties over random phase sequences."""

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
    Part,
    Phase,
    ResidencyLedger,
    Role,
    Transition,
    Work,
    phase_parts,
    plan_transitions,
)
from ppo_lifecycle._parts import parts_label

V, PF, PB = Phase.VALUE_FORWARD, Phase.POLICY_FORWARD, Phase.POLICY_BACKWARD
UPD, REFIT, CT, SAVE, W = (
    Phase.POLICY_UPDATE,
    Phase.REFIT,
    Phase.CRITIC_TRAIN,
    Phase.CHECKPOINT_SAVE,
    Phase.WAIT,
)
A, C = Role.ACTOR, Role.CRITIC
P, OPT, G, B = Part.PARAMETERS, Part.OPTIMIZER, Part.GRADIENTS, Part.BUFFERS
CHUNK = [V, PF, PB]
TAIL = [UPD, REFIT, CT]


def _render(plan: list[Transition | Work]) -> list[str]:
    return [str(step) for step in plan]


@pytest.mark.parametrize(
    ("phases", "kwargs", "expected"),
    [
        pytest.param(
            [*CHUNK, *TAIL],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="full-batch: two switches, the actor's parts come back as its phases need them",
        ),
        pytest.param(
            [*CHUNK, W, *CHUNK, *TAIL],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
                "actor.sleep(keep_grads)",
                "critic.wake_up(parameters+buffers)",
                "wait",
                "value_forward@critic",
                "critic.sleep(all)",
                # the kept gradients are named (resident after it), not moved
                "actor.wake_up(parameters+buffers+gradients)",
                "policy_forward@actor",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="two chunks: critic prepared for a forward before waiting, actor keeps gradients",
        ),
        pytest.param(
            [*CHUNK, W, W, W, *CHUNK, *TAIL],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
                "actor.sleep(keep_grads)",
                "critic.wake_up(parameters+buffers)",
                "wait",
                "wait",
                "wait",
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers+gradients)",
                "policy_forward@actor",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="empty selections: critic stays resident, no switch",
        ),
        pytest.param(
            [W, *CHUNK, W, *TAIL],
            {},
            [
                "wait",
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",  # prepared for the update before waiting
                "wait",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="wait before the update: the actor stays and its optimizer comes back first",
        ),
        pytest.param(
            [*CHUNK, *TAIL, SAVE],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
                "checkpoint_save@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "checkpoint_save@actor",
                "actor.sleep(all)",
                "critic.wake_up(parameters+buffers)",
            ],
            id="checkpoint: resident model saved first, critic left ready for a forward",
        ),
        pytest.param(
            [V, W, V, W, V, CT],
            {},
            [
                "value_forward@critic",
                "wait",
                "value_forward@critic",
                "wait",
                "value_forward@critic",
                "critic_train@critic",
            ],
            id="critic warmup: policy phases skipped, never a switch",
        ),
        pytest.param(
            [V, W, V, CT],
            {"resident_parts": FORWARD_PARTS},
            [
                "value_forward@critic",
                "wait",
                "value_forward@critic",
                "critic.wake_up(gradients+optimizer)",
                "critic_train@critic",
            ],
            id="critic resident for a forward: training wakes just the rest, no switch",
        ),
        pytest.param(
            [*CHUNK],
            {"resident": None, "end_resident": None},
            [
                "critic.wake_up(parameters+buffers)",
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
            ],
            id="cold start, nothing resident, leave as is",
        ),
        pytest.param(
            [PB, UPD],
            {"resident": C, "end_resident": None},
            [
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers+gradients)",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",
                "policy_update@actor",
            ],
            id="a backward straight after the critic wakes what a backward needs at once",
        ),
        pytest.param(
            [PF, PB, UPD],
            {"resident": C, "pending_gradients": True, "end_resident": None},
            [
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers+gradients)",
                "policy_forward@actor",
                "policy_backward@actor",
                "actor.wake_up(optimizer)",
                "policy_update@actor",
            ],
            id="resume mid-step with pending gradients",
        ),
        pytest.param(
            [UPD],
            {
                "resident": A,
                "resident_parts": FORWARD_PARTS,
                "pending_gradients": True,
                "end_resident": None,
            },
            ["actor.wake_up(optimizer)", "policy_update@actor"],
            id="the actor's pending gradients count as resident: only the optimizer comes back",
        ),
        pytest.param(
            [],
            {},
            [],
            id="empty step, critic already resident",
        ),
        pytest.param(
            [],
            {"resident": A, "pending_gradients": True},
            ["actor.sleep(keep_grads)", "critic.wake_up(parameters+buffers)"],
            id="empty step ends by preparing the critic for a forward",
        ),
        pytest.param(
            [],
            {"resident": C, "resident_parts": [Part.OPTIMIZER]},
            ["critic.wake_up(parameters+buffers)"],
            id="the end wakes the forward parts the resident critic lacks",
        ),
        pytest.param(
            [UPD, SAVE],
            {"resident": A, "pending_gradients": True},
            [
                "policy_update@actor",
                "checkpoint_save@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "checkpoint_save@critic",
            ],
            id="a checkpoint saves the resident actor first: one switch",
        ),
        pytest.param(
            [UPD, W, SAVE],
            {"resident": A, "pending_gradients": True},
            [
                "policy_update@actor",
                "wait",
                "checkpoint_save@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "checkpoint_save@critic",
            ],
            id="a wait before a checkpoint keeps the resident model: no switch for it",
        ),
        pytest.param(
            [*CHUNK, W],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up(parameters+buffers)",
                "policy_forward@actor",
                "actor.wake_up(gradients)",
                "policy_backward@actor",
                "actor.sleep(keep_grads)",
                "critic.wake_up(parameters+buffers)",
                "wait",
            ],
            id="a trailing wait prepares the end's model before waiting",
        ),
        pytest.param(
            [SAVE],
            {"resident": None},
            [
                "actor.wake_up",
                "checkpoint_save@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "checkpoint_save@critic",
            ],
            id="neither resident: the critic, left resident at the end, is saved last",
        ),
        pytest.param(
            [SAVE],
            {"resident": None, "end_resident": None},
            [
                "critic.wake_up",
                "checkpoint_save@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "checkpoint_save@actor",
            ],
            id="neither resident, no end model: the critic first",
        ),
    ],
)
def test_plan_table(phases: list[Phase], kwargs: dict[str, object], expected: list[str]) -> None:
    assert _render(plan_transitions(phases, **kwargs)) == expected  # type: ignore[arg-type]


def test_plan_errors_name_the_phase() -> None:
    with pytest.raises(ValueError, match=r"phases\[1\]: 'backward' is not a Phase"):
        plan_transitions([V, "backward"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"phases\[3\]: checkpoint_save while the actor"):
        plan_transitions([V, PF, PB, SAVE])
    with pytest.raises(ValueError, match="parts: empty selection"):
        plan_transitions([V], resident_parts=[])
    with pytest.raises(ValueError, match="parts: 'weights' is not a part"):
        plan_transitions([V], resident_parts=["weights"])  # type: ignore[list-item]


def test_keep_gradients_transition_carries_the_parts() -> None:
    plan = plan_transitions([*CHUNK, W, V])
    sleeps = [s for s in plan if isinstance(s, Transition) and s.action is Action.SLEEP]
    assert sleeps[1] == Transition(Role.ACTOR, Action.SLEEP, KEEP_GRADIENTS)
    assert Part.GRADIENTS not in sleeps[1].parts


def test_phase_parts_table() -> None:
    assert {P, B} == FORWARD_PARTS
    assert {P, B, G} == BACKWARD_PARTS
    assert {phase: phase_parts(phase) for phase in Phase} == {
        V: FORWARD_PARTS,
        PF: FORWARD_PARTS,
        PB: BACKWARD_PARTS,
        UPD: ALL_PARTS,
        REFIT: FORWARD_PARTS,
        CT: ALL_PARTS,
        SAVE: ALL_PARTS,
        W: frozenset(),
    }
    assert phase_parts("value_forward") == FORWARD_PARTS  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nap"):
        phase_parts("nap")  # type: ignore[arg-type]


def test_parts_label_and_transition_names() -> None:
    assert parts_label(ALL_PARTS) == "all"
    assert parts_label(KEEP_GRADIENTS) == "keep_grads"
    # named in wake-up order (the reverse of the order parts go to sleep in)
    assert parts_label(FORWARD_PARTS) == "parameters+buffers"
    assert parts_label(BACKWARD_PARTS) == "parameters+buffers+gradients"
    assert parts_label(frozenset({OPT, P})) == "parameters+optimizer"
    assert parts_label(frozenset({G})) == "gradients"
    assert str(Transition(C, Action.WAKE_UP)) == "critic.wake_up"
    assert str(Transition(C, Action.WAKE_UP, FORWARD_PARTS)) == "critic.wake_up(parameters+buffers)"
    assert str(Transition(A, Action.WAKE_UP, frozenset({OPT}))) == "actor.wake_up(optimizer)"
    assert str(Transition(A, Action.SLEEP, KEEP_GRADIENTS)) == "actor.sleep(keep_grads)"
    assert str(Transition(A, Action.SLEEP)) == "actor.sleep(all)"


_phase_lists = st.lists(
    st.sampled_from([p for p in Phase if p is not Phase.CHECKPOINT_SAVE]), max_size=25
)
_some_parts = st.frozensets(st.sampled_from(list(Part)), min_size=1)


@given(_phase_lists, st.sampled_from([None, A, C]), st.booleans(), _some_parts)
@example([Phase.POLICY_FORWARD], A, True, frozenset({G}))  # found by hypothesis
def test_plan_properties(
    phases: list[Phase], resident: Role | None, pending: bool, resident_parts: frozenset[Part]
) -> None:
    plan = plan_transitions(
        phases, resident=resident, pending_gradients=pending, resident_parts=resident_parts
    )
    # Work items are the phases, in order, untouched.
    assert [s.phase for s in plan if isinstance(s, Work)] == phases
    # Replay, per part: each work item finds what its phase needs resident on its model,
    # which is the only one holding more than the actor's kept gradients; no transition
    # is redundant and a wake-up brings back exactly what the model's next work needs.
    held: dict[Role, frozenset[Part]] = {A: frozenset(), C: frozenset()}
    if resident is not None:
        held[resident] = resident_parts
    if pending:
        held[A] |= {G}
    kept_at_start = pending

    def kept(role: Role) -> frozenset[Part]:
        return frozenset({G}) if role is A and pending else frozenset()

    def in_use() -> list[Role]:
        return [r for r in Role if held[r] - kept(r)]

    def next_needs(role: Role, index: int) -> frozenset[Part]:
        later = (s for s in plan[index + 1 :] if isinstance(s, Work) and s.role is role)
        upcoming = next(later, None)
        return FORWARD_PARTS if upcoming is None else phase_parts(upcoming.phase)  # end: critic

    switch_wakes = 0
    for i, step in enumerate(plan):
        if isinstance(step, Transition):
            before, keep = held[step.role], kept(step.role)
            if step.action is Action.WAKE_UP:
                assert step.parts - before, f"redundant {step} at {i}"
                assert step.parts & before <= keep, f"{step} at {i} names resident parts"
                assert step.parts - keep == next_needs(step.role, i) - before - keep, (step, i)
                switch_wakes += in_use() != [step.role]
                held[step.role] = before | step.parts
            else:
                assert before - keep, f"redundant {step} at {i}: nothing but kept gradients"
                assert step.parts == (KEEP_GRADIENTS if keep else ALL_PARTS), (step, i)
                held[step.role] = before - step.parts
            assert len(in_use()) <= 1, f"two models resident after {step} at {i}: {held}"
            assert not pending or G in held[A], f"kept gradients left at {i}"
        else:
            if step.role is not None:
                assert phase_parts(step.phase) <= held[step.role], f"{step} at {i}: {held}"
                assert in_use() == [step.role], f"{step} at {i}: {held}"
            pending = (pending or step.phase is Phase.POLICY_BACKWARD) and (
                step.phase is not Phase.POLICY_UPDATE
            )
    assert in_use() == [C] and held[C] >= FORWARD_PARTS  # ready for the next value forward
    # The wakes that change the model are the minimum: one per change of the model in use.
    used = [s.role for s in plan if isinstance(s, Work) and s.role is not None] + [C]
    # an actor holding only its kept gradients starts asleep in effect
    start = None if resident is A and kept_at_start and resident_parts <= {G} else resident
    changes = sum(1 for a, b in zip([start, *used], used, strict=False) if a is not b)
    assert switch_wakes == changes
    # And the ledger agrees the device never holds two full models.
    ledger = ResidencyLedger()
    sizes = {Part.PARAMETERS: 10, Part.OPTIMIZER: 20, Part.GRADIENTS: 10, Part.BUFFERS: 1}
    for role in Role:
        initial = resident_parts if role is resident else frozenset()
        if role is A and pending:
            initial |= {G}
        ledger.register(role, device="cuda:0", part_bytes=sizes, resident=initial)
    ledger.check_plan(plan)
