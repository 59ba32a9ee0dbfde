"""placement_layout / check_streaming_layout: the pure table (no Ray)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from ppo_placement import Layout, check_streaming_layout, placement_layout


@pytest.mark.parametrize(
    ("kwargs", "num_gpus", "rollout_offset", "train", "rollout"),
    [
        pytest.param(
            {"actor_gpus": 4, "rollout_gpus": 2, "train_only": True}, 4, 0, 4, 0, id="train-only"
        ),
        pytest.param(
            {"actor_gpus": 4, "rollout_gpus": 0, "train_only": True},
            4,
            0,
            4,
            0,
            id="train-only-no-rollout-gpus",
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 8, "train_only": True, "colocate": True},
            2,
            0,
            2,
            0,
            id="train-only-wins-over-colocate",
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 3, "rollout_external": True, "rollout_only": True},
            0,
            0,
            0,
            0,
            id="external-rollout-only",
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 0, "rollout_external": True, "rollout_only": True},
            0,
            0,
            0,
            0,
            id="external-rollout-only-zero",
        ),
        pytest.param(
            {"actor_gpus": 4, "rollout_gpus": 2, "rollout_external": True},
            4,
            4,
            4,
            0,
            id="external-rollout",
        ),
        pytest.param(
            {"actor_gpus": 3, "rollout_gpus": 0, "rollout_external": True},
            3,
            3,
            3,
            0,
            id="external-rollout-no-local-gpus",
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 3, "rollout_only": True},
            3,
            0,
            0,
            3,
            id="rollout-only",
        ),
        pytest.param(
            {"actor_gpus": 8, "rollout_gpus": 2, "rollout_only": True, "colocate": True},
            2,
            0,
            0,
            2,
            id="rollout-only-wins-over-colocate",
        ),
        pytest.param(
            {"actor_gpus": 4, "rollout_gpus": 2, "colocate": True},
            4,
            0,
            4,
            2,
            id="colocate-actor-larger",
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 4, "colocate": True},
            4,
            0,
            2,
            4,
            id="colocate-rollout-larger",
        ),
        pytest.param(
            {"actor_gpus": 4, "rollout_gpus": 4, "colocate": True},
            4,
            0,
            4,
            4,
            id="colocate-equal",
        ),
        pytest.param({"actor_gpus": 4, "rollout_gpus": 2}, 6, 4, 4, 2, id="separate"),
        pytest.param({"actor_gpus": 1, "rollout_gpus": 1}, 2, 1, 1, 1, id="separate-minimal"),
    ],
)
def test_layout_table(
    kwargs: dict[str, Any], num_gpus: int, rollout_offset: int, train: int, rollout: int
) -> None:
    layout = placement_layout(**kwargs)
    assert (layout.num_gpus, layout.rollout_offset) == (num_gpus, rollout_offset)
    assert layout.train_bundles == range(train)
    assert layout.rollout_bundles == range(rollout_offset, rollout_offset + rollout)
    # Every bundle a role uses exists; the critic adds none (it is the actor's range).
    assert all(b < layout.num_gpus for b in layout.train_bundles)
    assert all(b < layout.num_gpus for b in layout.rollout_bundles)
    if not layout.colocate:
        assert not set(layout.train_bundles) & set(layout.rollout_bundles)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"actor_gpus": -1, "rollout_gpus": 2}, r"actor_gpus=-1", id="negative-actor"),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": -3}, r"rollout_gpus=-3", id="negative-rollout"
        ),
        pytest.param(
            {"actor_gpus": 2.0, "rollout_gpus": 2}, r"actor_gpus=2.0 must be an int", id="float"
        ),
        pytest.param(
            {"actor_gpus": True, "rollout_gpus": 2}, r"actor_gpus=True must be an int", id="bool"
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 2, "colocate": True, "rollout_external": True},
            r"colocate=True and rollout_external=True",
            id="colocate-with-external",
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 2, "train_only": True, "rollout_only": True},
            r"train_only=True and rollout_only=True",
            id="train-only-with-rollout-only",
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 2}, r"actor_gpus=0 but training", id="no-actor"
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 2, "train_only": True},
            r"actor_gpus=0 but training",
            id="no-actor-train-only",
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 2, "rollout_external": True},
            r"actor_gpus=0 but training",
            id="no-actor-external",
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 2, "colocate": True},
            r"actor_gpus=0 but training",
            id="no-actor-colocate",
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 0}, r"rollout_gpus=0 but generation", id="no-rollout"
        ),
        pytest.param(
            {"actor_gpus": 2, "rollout_gpus": 0, "colocate": True},
            r"rollout_gpus=0 but generation",
            id="no-rollout-colocate",
        ),
        pytest.param(
            {"actor_gpus": 0, "rollout_gpus": 0, "rollout_only": True},
            r"rollout_gpus=0 but generation",
            id="no-rollout-rollout-only",
        ),
    ],
)
def test_layout_errors_name_the_inputs(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        placement_layout(**kwargs)


def test_layout_is_frozen() -> None:
    layout = placement_layout(actor_gpus=2, rollout_gpus=2)
    with pytest.raises(AttributeError):
        layout.num_gpus = 3  # type: ignore[misc]
    assert layout == Layout(
        num_gpus=4, rollout_offset=2, actor_gpus=2, rollout_gpus=2, colocate=False
    )


@pytest.mark.parametrize(
    ("colocate", "streaming", "rejected"),
    [
        pytest.param(True, True, True, id="colocated-streaming-rejected"),
        pytest.param(True, False, False, id="colocated-full-batch-ok"),
        pytest.param(False, True, False, id="separate-streaming-ok"),
        pytest.param(False, False, False, id="separate-full-batch-ok"),
    ],
)
def test_streaming_needs_separate_rollout_gpus(
    colocate: bool, streaming: bool, rejected: bool
) -> None:
    layout = placement_layout(actor_gpus=2, rollout_gpus=2, colocate=colocate)
    if rejected:
        with pytest.raises(ValueError, match=r"streaming PPO needs separate generation GPUs"):
            check_streaming_layout(layout, streaming=streaming)
    else:
        check_streaming_layout(layout, streaming=streaming)


def test_layout_does_not_import_ray() -> None:
    code = (
        "import sys; from ppo_placement import placement_layout; "
        "placement_layout(actor_gpus=1, rollout_gpus=1); "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_layout_problems_are_data_all_at_once() -> None:
    from ppo_placement import LayoutError, layout_problems, streaming_layout_problems

    problems = layout_problems(actor_gpus=0, rollout_gpus=-1, colocate=True, rollout_external=True)
    assert [(p.field, p.value) for p in problems] == [
        ("rollout_gpus", -1),
        ("colocate", True),
        ("actor_gpus", 0),
    ]
    assert all(p.message and p.fix for p in problems)
    with pytest.raises(LayoutError) as info:
        placement_layout(actor_gpus=0, rollout_gpus=-1, colocate=True, rollout_external=True)
    assert info.value.problems == problems
    assert layout_problems(actor_gpus=1, rollout_gpus=1) == []
    colocated = placement_layout(actor_gpus=1, rollout_gpus=1, colocate=True)
    assert [p.field for p in streaming_layout_problems(colocated, streaming=True)] == ["colocate"]
    assert streaming_layout_problems(colocated, streaming=False) == []
