"""The pure chunk gate: the document's worked examples, errors, and brute-force checks."""

from __future__ import annotations

import doctest
import itertools

import ppo_sampler._chunk
import pytest
from ppo_sampler import (
    chunk_schedule,
    group_alignment,
    plan_chunk,
    single_chunk_only,
    tail_floor,
)

# The examples of "Tail-aware selection" in the streaming design document
# (colocated-ppo-streaming.md, the project's source document; not shipped).
SCHEDULES = [
    pytest.param([88, 120, 128], 128, 32, 1, [88, 40], id="88+40-not-88+32+8"),
    pytest.param([88, 128], 128, 32, 1, [88, 40], id="88-then-flush-40"),
    pytest.param([112, 128], 128, 32, 1, [112, 16], id="112-runs-leaving-exactly-tail-floor"),
    *(
        pytest.param([ready, 128], 128, 32, 1, [128], id=f"{ready}-ready-waits-for-all-128")
        for ready in (113, 120, 127)
    ),
    *(
        pytest.param(list(range(129)), 128, low, 1, [128], id=f"min-{low}-one-chunk")
        for low in (86, 100, 127)
    ),
    pytest.param(list(range(129)), 128, 85, 1, [85, 43], id="min-85-still-splits"),
    pytest.param(list(range(129)), 128, 128, 1, [128], id="min-equals-batch-full-batch"),
    pytest.param([128], 128, 32, 1, [128], id="all-ready-at-once"),
    pytest.param([0, 31, 32, 64, 128], 128, 32, 1, [32, 32, 64], id="chunks-at-the-minimum"),
    pytest.param([45, 100, 128], 128, 32, 8, [40, 56, 32], id="aligned-down-to-8"),
    pytest.param([100, 250, 256], 256, 32, 1, [100, 156], id="doc-config-256-min-32"),
]


@pytest.mark.parametrize(("polls", "batch", "low", "alignment", "expected"), SCHEDULES)
def test_document_schedules(
    polls: list[int], batch: int, low: int, alignment: int, expected: list[int]
) -> None:
    assert chunk_schedule(polls, batch=batch, min_groups=low, alignment=alignment) == expected


PLANS = [
    pytest.param(88, 128, 32, 1, 88, id="88-of-128-runs"),
    pytest.param(32, 40, 32, 1, 0, id="32-of-40-would-leave-8-defers"),
    pytest.param(112, 128, 32, 1, 112, id="112-leaves-tail-floor-16"),
    pytest.param(113, 128, 32, 1, 0, id="113-leaves-15-waits"),
    pytest.param(127, 128, 32, 1, 0, id="127-leaves-1-waits"),
    pytest.param(8, 8, 32, 1, 8, id="final-remainder-flushes-below-minimum"),
    pytest.param(200, 40, 32, 1, 40, id="capped-at-remainder"),
    pytest.param(31, 128, 32, 1, 0, id="below-minimum-waits"),
    pytest.param(0, 128, 32, 1, 0, id="nothing-ready"),
    pytest.param(127, 128, 128, 1, 0, id="full-batch-waits-for-all"),
    pytest.param(45, 128, 32, 8, 40, id="rounded-down-to-alignment"),
    pytest.param(39, 128, 32, 8, 32, id="aligned-take-at-minimum"),
    pytest.param(31, 128, 30, 8, 0, id="aligned-take-below-minimum"),
    pytest.param(119, 128, 32, 8, 112, id="aligned-112-leaves-16"),
    pytest.param(120, 128, 32, 8, 0, id="aligned-120-leaves-8-defers-not-trims"),
]


@pytest.mark.parametrize(("ready", "remaining", "low", "alignment", "expected"), PLANS)
def test_plan_chunk_examples(
    ready: int, remaining: int, low: int, alignment: int, expected: int
) -> None:
    got = plan_chunk(ready=ready, remaining=remaining, min_groups=low, alignment=alignment)
    assert got == expected


@pytest.mark.parametrize(
    ("low", "expected"),
    [
        pytest.param(1, False, id="min-1"),
        pytest.param(32, False, id="min-32"),
        pytest.param(85, False, id="min-85-last-splittable"),
        *(pytest.param(low, True, id=f"min-{low}") for low in (86, 87, 100, 127)),
        pytest.param(128, True, id="min-128-full-batch"),
    ],
)
def test_single_chunk_only_batch_128(low: int, expected: bool) -> None:
    assert single_chunk_only(batch=128, min_groups=low) is expected


def test_single_chunk_only_range_is_86_to_128() -> None:
    single = [low for low in range(1, 129) if single_chunk_only(batch=128, min_groups=low)]
    assert single == list(range(86, 129))


@pytest.mark.parametrize(
    ("low", "floor"),
    [pytest.param(1, 1, id="1"), pytest.param(31, 16, id="31"), pytest.param(32, 16, id="32")],
)
def test_tail_floor_is_ceil_half(low: int, floor: int) -> None:
    assert tail_floor(min_groups=low) == floor


def _single_chunk_brute(batch: int, low: int, alignment: int) -> bool:
    """A split exists iff some poll count makes the first chunk smaller than the batch."""
    return all(
        plan_chunk(ready=r, remaining=batch, min_groups=low, alignment=alignment) in (0, batch)
        for r in range(batch + 1)
    )


def test_single_chunk_only_matches_brute_force() -> None:
    for alignment, units in itertools.product((1, 2, 3, 8), range(1, 13)):
        batch = alignment * units
        for low in range(1, batch + 1):
            assert single_chunk_only(
                batch=batch, min_groups=low, alignment=alignment
            ) is _single_chunk_brute(batch, low, alignment), (batch, low, alignment)


def _alignment_brute(gpp: int, adp: int, cdp: int, amb: int | None, cmb: int | None) -> int:
    for groups in itertools.count(1):
        samples = groups * gpp
        if samples % (adp * (amb or 1)) == 0 and samples % (cdp * (cmb or 1)) == 0:
            return groups
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"generations_per_prompt": 8, "actor_dp": 8, "critic_dp": 8}, 1, id="8x8"),
        pytest.param({"generations_per_prompt": 1, "actor_dp": 4, "critic_dp": 6}, 12, id="lcm"),
        pytest.param({"generations_per_prompt": 4, "actor_dp": 2, "critic_dp": 8}, 2, id="gcd"),
        pytest.param(
            {"generations_per_prompt": 4, "actor_dp": 2, "critic_dp": 8, "critic_micro_batch": 2},
            4,
            id="critic-micro-batch",
        ),
        pytest.param(
            {"generations_per_prompt": 3, "actor_dp": 2, "critic_dp": 2, "actor_micro_batch": 5},
            10,
            id="actor-micro-batch",
        ),
    ],
)
def test_group_alignment_examples(kwargs: dict[str, int], expected: int) -> None:
    assert group_alignment(**kwargs) == expected


def test_group_alignment_matches_brute_force() -> None:
    for gpp, adp, cdp, amb, cmb in itertools.product(
        (1, 2, 3, 4, 16), (1, 2, 3, 8), (1, 4, 6), (None, 1, 2, 3), (None, 2, 4)
    ):
        got = group_alignment(
            generations_per_prompt=gpp,
            actor_dp=adp,
            critic_dp=cdp,
            actor_micro_batch=amb,
            critic_micro_batch=cmb,
        )
        assert got == _alignment_brute(gpp, adp, cdp, amb, cmb), (gpp, adp, cdp, amb, cmb)


BAD_PLANS = [
    pytest.param({"ready": -1}, "ready=-1", id="negative-ready"),
    pytest.param({"remaining": 0}, "remaining=0", id="zero-remaining"),
    pytest.param({"remaining": -8}, "remaining=-8", id="negative-remaining"),
    pytest.param({"min_groups": 0}, "min_groups=0", id="zero-min"),
    pytest.param({"alignment": 0}, "alignment=0", id="zero-alignment"),
    pytest.param({"remaining": 30, "alignment": 8}, "remaining=30", id="unaligned-remaining"),
    pytest.param({"ready": 2.5}, "ready=2.5", id="float-ready"),
    pytest.param({"ready": True}, "ready=True", id="bool-ready"),
]


@pytest.mark.parametrize(("override", "message"), BAD_PLANS)
def test_plan_chunk_rejects(override: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = {"ready": 10, "remaining": 128, "min_groups": 32, "alignment": 1}
    kwargs.update(override)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        plan_chunk(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("polls", "kwargs", "message"),
    [
        pytest.param([10, 5, 128], {}, r"ready_counts\[1\]=5", id="decreasing"),
        pytest.param([10, 64], {}, "must end at batch=128", id="not-ending-at-batch"),
        pytest.param([], {}, "must end at batch=128", id="empty"),
        pytest.param([10, 129], {}, r"ready_counts\[1\]=129", id="above-batch"),
        pytest.param([-1, 128], {}, r"ready_counts\[0\]=-1", id="negative"),
        pytest.param([128], {"min_groups": 129}, "min_groups=129 exceeds", id="min-above-batch"),
        pytest.param([128], {"alignment": 3}, "batch=128 is not a multiple", id="unaligned"),
        pytest.param([0], {"batch": 0}, "batch=0", id="zero-batch"),
    ],
)
def test_chunk_schedule_rejects(polls: list[int], kwargs: dict[str, int], message: str) -> None:
    args = {"batch": 128, "min_groups": 32, "alignment": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        chunk_schedule(polls, **args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"actor_dp": 0}, "actor_dp=0", id="zero-actor-dp"),
        pytest.param({"critic_dp": -2}, "critic_dp=-2", id="negative-critic-dp"),
        pytest.param({"generations_per_prompt": 0}, "generations_per_prompt=0", id="zero-gpp"),
        pytest.param({"actor_micro_batch": 0}, "actor_micro_batch=0", id="zero-actor-mb"),
        pytest.param({"critic_micro_batch": 1.5}, "critic_micro_batch=1.5", id="float-critic-mb"),
    ],
)
def test_group_alignment_rejects(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"generations_per_prompt": 4, "actor_dp": 2, "critic_dp": 2}
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        group_alignment(**(args | kwargs))  # type: ignore[arg-type]


def test_single_chunk_only_rejects_min_above_batch() -> None:
    with pytest.raises(ValueError, match="min_groups=129 exceeds batch=128"):
        single_chunk_only(batch=128, min_groups=129)


def test_pinned_functions_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        plan_chunk(10, 128, 32)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        single_chunk_only(128, 32)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        group_alignment(4, 2, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        chunk_schedule([128], 128, 32)  # type: ignore[call-arg]


def test_docstring_examples_hold() -> None:
    result = doctest.testmod(ppo_sampler._chunk, raise_on_error=False)
    assert result.attempted >= 2
    assert result.failed == 0
