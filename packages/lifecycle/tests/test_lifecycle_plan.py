"""The driver's plan as a table, plus properties over random phase sequences."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ppo_lifecycle import (
    KEEP_GRADIENTS,
    Action,
    Part,
    Phase,
    ResidencyLedger,
    Role,
    Transition,
    Work,
    plan_transitions,
)

V, PF, PB = Phase.VALUE_FORWARD, Phase.POLICY_FORWARD, Phase.POLICY_BACKWARD
UPD, REFIT, CT, SAVE, W = (
    Phase.POLICY_UPDATE,
    Phase.REFIT,
    Phase.CRITIC_TRAIN,
    Phase.CHECKPOINT_SAVE,
    Phase.WAIT,
)
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
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="full-batch: value forward first, early refit, two switches",
        ),
        pytest.param(
            [*CHUNK, W, *CHUNK, *TAIL],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
                "actor.sleep(keep_grads)",
                "critic.wake_up",
                "wait",
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="two chunks: critic prepared before waiting, actor keeps gradients",
        ),
        pytest.param(
            [*CHUNK, W, W, W, *CHUNK, *TAIL],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
                "actor.sleep(keep_grads)",
                "critic.wake_up",
                "wait",
                "wait",
                "wait",
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
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
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
                "wait",
                "policy_update@actor",
                "refit@actor",
                "actor.sleep(all)",
                "critic.wake_up",
                "critic_train@critic",
            ],
            id="wait before the update: the actor stays, gradients and all",
        ),
        pytest.param(
            [*CHUNK, *TAIL, SAVE],
            {},
            [
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
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
                "critic.wake_up",
            ],
            id="checkpoint: resident model saved first, critic left ready",
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
            [*CHUNK],
            {"resident": None, "end_resident": None},
            [
                "critic.wake_up",
                "value_forward@critic",
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
            ],
            id="cold start, nothing resident, leave as is",
        ),
        pytest.param(
            [PF, PB, UPD],
            {"resident": Role.CRITIC, "pending_gradients": True, "end_resident": None},
            [
                "critic.sleep(all)",
                "actor.wake_up",
                "policy_forward@actor",
                "policy_backward@actor",
                "policy_update@actor",
            ],
            id="resume mid-step with pending gradients",
        ),
        pytest.param(
            [],
            {},
            [],
            id="empty step, critic already resident",
        ),
        pytest.param(
            [],
            {"resident": Role.ACTOR, "pending_gradients": True},
            ["actor.sleep(keep_grads)", "critic.wake_up"],
            id="empty step ends by preparing the critic",
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


def test_keep_gradients_transition_carries_the_parts() -> None:
    plan = plan_transitions([*CHUNK, W, V])
    sleeps = [s for s in plan if isinstance(s, Transition) and s.action is Action.SLEEP]
    assert sleeps[1] == Transition(Role.ACTOR, Action.SLEEP, KEEP_GRADIENTS)
    assert Part.GRADIENTS not in sleeps[1].parts


_phase_lists = st.lists(
    st.sampled_from([p for p in Phase if p is not Phase.CHECKPOINT_SAVE]), max_size=25
)


@given(_phase_lists, st.sampled_from([None, Role.ACTOR, Role.CRITIC]))
def test_plan_properties(phases: list[Phase], resident: Role | None) -> None:
    plan = plan_transitions(phases, resident=resident)
    # Work items are the phases, in order, untouched.
    assert [s.phase for s in plan if isinstance(s, Work)] == phases
    # Replay: each work item runs on its model while it is the only resident one,
    # no model wakes twice or sleeps twice, and every wake is needed.
    state = {Role.ACTOR: resident is Role.ACTOR, Role.CRITIC: resident is Role.CRITIC}
    pending = False
    for i, step in enumerate(plan):
        if isinstance(step, Transition):
            awake = state[step.role]
            assert awake is (step.action is Action.SLEEP), f"redundant {step} at {i}"
            state[step.role] = step.action is Action.WAKE_UP
            assert sum(state.values()) <= 1
            if step.action is Action.SLEEP and step.role is Role.ACTOR:
                assert (step.parts == KEEP_GRADIENTS) is pending
        else:
            if step.role is not None:
                assert state[step.role], f"{step} on a sleeping model"
            pending = (pending or step.phase is Phase.POLICY_BACKWARD) and (
                step.phase is not Phase.POLICY_UPDATE
            )
    # The number of wakes is the minimum: one per change of the model in use.
    used = [s.role for s in plan if isinstance(s, Work) and s.role is not None] + [Role.CRITIC]
    changes = sum(1 for a, b in zip([resident, *used], used, strict=False) if a is not b)
    wakes = sum(1 for s in plan if isinstance(s, Transition) and s.action is Action.WAKE_UP)
    assert wakes == changes
    # And the ledger agrees the device never holds two full models.
    ledger = ResidencyLedger()
    sizes = {Part.PARAMETERS: 10, Part.OPTIMIZER: 20, Part.GRADIENTS: 10, Part.BUFFERS: 1}
    for role in Role:
        ledger.register(
            role, device="cuda:0", part_bytes=sizes, resident=set(Part) if role is resident else ()
        )
    ledger.check_plan(plan)
