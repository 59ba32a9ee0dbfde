"""The residency ledger: bytes per part per device, and the over-budget error."""

from __future__ import annotations

import pytest
from ppo_lifecycle import (
    BACKWARD_PARTS,
    FORWARD_PARTS,
    KEEP_GRADIENTS,
    Action,
    Part,
    Phase,
    ResidencyError,
    ResidencyLedger,
    Role,
    Transition,
    plan_transitions,
)

ACTOR = {Part.PARAMETERS: 100, Part.OPTIMIZER: 200, Part.GRADIENTS: 100, Part.BUFFERS: 4}
CRITIC = {Part.PARAMETERS: 90, Part.OPTIMIZER: 180, Part.GRADIENTS: 90, Part.BUFFERS: 0}


def _ledger(**kwargs: object) -> ResidencyLedger:
    ledger = ResidencyLedger(**kwargs)  # type: ignore[arg-type]
    for device in ("cuda:0", "cuda:1"):
        ledger.register("actor", device=device, part_bytes=ACTOR)
        ledger.register("critic", device=device, part_bytes=CRITIC, resident=set(Part))
    return ledger


def test_default_budget_is_one_model_plus_the_others_gradients() -> None:
    ledger = _ledger()
    assert ledger.budget("cuda:0") == max(404 + 90, 360 + 100)
    ledger.sleep("critic")
    ledger.wake_up("actor")
    ledger.sleep("actor", KEEP_GRADIENTS)
    ledger.wake_up("critic")  # critic + actor's kept gradients fits
    assert ledger.resident_parts("actor") == {Part.GRADIENTS}
    assert ledger.resident_bytes("cuda:1") == 360 + 100
    assert ledger.report()["cuda:0"]["actor"] == {"gradients": 100}


def test_two_full_models_are_refused_and_nothing_changes() -> None:
    ledger = _ledger()
    with pytest.raises(ResidencyError, match=r"actor.wake_up\(all\): cuda:0 would hold 764 bytes"):
        ledger.wake_up("actor")
    assert ledger.resident_parts("actor") == frozenset()
    assert ledger.resident_bytes("cuda:0") == 360


def test_wake_up_grows_only_the_named_parts() -> None:
    ledger = _ledger()
    ledger.sleep("critic")
    ledger.wake_up("actor", FORWARD_PARTS)
    assert ledger.resident_parts("actor", "cuda:1") == FORWARD_PARTS
    assert ledger.resident_bytes("cuda:0") == 104
    ledger.apply(Transition(Role.ACTOR, Action.WAKE_UP, BACKWARD_PARTS))  # adds the gradients
    assert ledger.resident_parts("actor") == BACKWARD_PARTS
    assert ledger.resident_bytes("cuda:1") == 204
    ledger.wake_up("actor", ["optimizer"])  # type: ignore[list-item]
    assert ledger.resident_parts("actor") == set(Part)
    ledger.sleep("actor", KEEP_GRADIENTS)
    ledger.wake_up("critic", FORWARD_PARTS)
    assert ledger.report()["cuda:0"] == {
        "actor": {"gradients": 100},
        "critic": {"parameters": 90, "buffers": 0},
    }
    with pytest.raises(ValueError, match="parts: empty selection"):
        ledger.wake_up("actor", [])
    # An over-budget partial wake-up names its parts and changes nothing.
    full_critic = _ledger()
    with pytest.raises(ResidencyError, match=r"actor.wake_up\(optimizer\): cuda:0 would hold 560"):
        full_critic.wake_up("actor", [Part.OPTIMIZER])
    assert full_critic.resident_parts("actor") == frozenset()
    with pytest.raises(ResidencyError, match=r"step 0 \(actor.wake_up\(parameters\+optimizer\)\)"):
        full_critic.check_plan(
            [Transition(Role.ACTOR, Action.WAKE_UP, frozenset({Part.PARAMETERS, Part.OPTIMIZER}))]
        )


def test_configurable_budget() -> None:
    roomy = _ledger(budget_bytes=10_000)
    roomy.wake_up("actor")  # a big device fits both
    assert roomy.resident_bytes("cuda:0") == 764
    tight = _ledger(budget_bytes={"cuda:0": 10_000, "cuda:1": 400})
    with pytest.raises(ResidencyError, match="cuda:1"):
        tight.wake_up("actor")
    with pytest.raises(ValueError, match="budget_bytes: -1"):
        ResidencyLedger(budget_bytes=-1)


def test_a_refused_wake_up_on_one_device_changes_no_device() -> None:
    ledger = ResidencyLedger(budget_bytes={"d0": 1000, "d1": 100})
    for device in ("d0", "d1"):  # fits on d0, not on d1
        ledger.register("actor", device=device, part_bytes={Part.PARAMETERS: 200})
    with pytest.raises(ResidencyError, match="d1"):
        ledger.wake_up("actor", FORWARD_PARTS)
    assert ledger.resident_parts("actor", "d0") == frozenset()
    assert ledger.resident_bytes("d0") == 0


def test_a_refused_registration_leaves_nothing_registered() -> None:
    ledger = ResidencyLedger(budget_bytes=100)
    with pytest.raises(ResidencyError):
        ledger.register("a", device="d0", part_bytes={Part.PARAMETERS: 200}, resident=set(Part))
    assert ledger.models() == []
    ledger.register("a", device="d0", part_bytes={Part.PARAMETERS: 50}, resident=set(Part))
    assert ledger.resident_bytes("d0") == 50


def test_a_zero_budget_is_a_device_that_holds_nothing() -> None:
    ledger = ResidencyLedger(budget_bytes=0)
    assert ledger.budget("x") == 0
    ledger.register("empty", device="x", part_bytes={}, resident=set(Part))
    ledger.register("actor", device="x", part_bytes={Part.PARAMETERS: 1})
    with pytest.raises(ResidencyError):
        ledger.wake_up("actor", FORWARD_PARTS)


def test_register_errors_name_the_problem() -> None:
    ledger = _ledger()
    with pytest.raises(ValueError, match="already registered"):
        ledger.register("actor", device="cuda:0", part_bytes=ACTOR)
    with pytest.raises(ValueError, match="not registered"):
        ledger.wake_up("reward_model")
    with pytest.raises(ValueError, match=r"part_bytes\[optimizer\]: -5"):
        ledger.register("ref", device="cuda:0", part_bytes={Part.OPTIMIZER: -5})


def test_check_plan_accepts_the_planned_schedule_and_rejects_a_bad_order() -> None:
    ledger = _ledger()
    phases = [Phase.VALUE_FORWARD, Phase.POLICY_FORWARD, Phase.POLICY_BACKWARD, Phase.WAIT] * 2 + [
        Phase.POLICY_UPDATE,
        Phase.REFIT,
        Phase.CRITIC_TRAIN,
        Phase.CHECKPOINT_SAVE,
    ]
    ledger.check_plan(plan_transitions(phases))
    assert ledger.resident_parts("critic") == set(Part)  # check_plan changes nothing
    bad = [Transition(Role.ACTOR, Action.WAKE_UP), Transition(Role.CRITIC, Action.SLEEP)]
    with pytest.raises(ResidencyError, match=r"plan step 0 \(actor.wake_up\)"):
        ledger.check_plan(bad)
