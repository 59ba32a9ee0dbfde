"""``async_rl.deterministic_chunks``: each step cut into fixed blocks of its dispatch order,
each released once complete, in order (``plan_fixed_chunk``, ``fixed_chunk_sizes``, the
``in_order`` sampler's ``fixed_chunks`` and its config)."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest
from ppo_sampler import (
    InOrderSampler,
    SamplerConfig,
    fixed_chunk_sizes,
    make_sampler,
    plan_chunk,
    plan_fixed_chunk,
    tail_floor,
)


@pytest.mark.parametrize(
    ("batch", "min_groups", "alignment", "sizes"),
    [
        pytest.param(64, 16, 1, [16, 16, 16, 16], id="even"),
        pytest.param(72, 16, 1, [16, 16, 16, 16, 8], id="last-partial-at-tail-floor"),
        pytest.param(70, 16, 1, [16, 16, 16, 22], id="last-below-floor-merged"),
        pytest.param(10, 4, 1, [4, 4, 2], id="last-below-minimum"),
        pytest.param(16, 3, 2, [4, 4, 4, 4], id="minimum-rounded-up-to-alignment"),
        pytest.param(20, 5, 2, [6, 6, 8], id="aligned-merge"),
        pytest.param(16, 16, 1, [16], id="full-batch"),
        pytest.param(3, 1, 1, [1, 1, 1], id="minimum-one"),
    ],
)
def test_fixed_chunk_sizes(batch: int, min_groups: int, alignment: int, sizes: list[int]) -> None:
    assert fixed_chunk_sizes(batch=batch, min_groups=min_groups, alignment=alignment) == sizes


def test_every_fixed_block_is_a_chunk_plan_chunk_accepts() -> None:
    # aligned, at least the minimum unless final, never leaving less than the tail floor
    for batch, min_groups, alignment in itertools.product(range(1, 41), range(1, 41), (1, 2, 3)):
        if min_groups > batch or batch % alignment:
            continue
        sizes = fixed_chunk_sizes(batch=batch, min_groups=min_groups, alignment=alignment)
        assert sum(sizes) == batch
        left = batch
        for size in sizes:
            assert size % alignment == 0
            kw = {"remaining": left, "min_groups": min_groups, "alignment": alignment}
            assert plan_chunk(ready=size, **kw) == size, (batch, min_groups, alignment, sizes)
            assert plan_fixed_chunk(ready=size, **kw) == size
            assert plan_fixed_chunk(ready=size - 1, **kw) == 0  # waits for all of it
            left -= size
            assert left == 0 or left >= tail_floor(min_groups=min_groups)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param({"remaining": 0}, "remaining=0", id="remaining"),
        pytest.param({"remaining": 9, "alignment": 2}, "not a multiple of alignment", id="align"),
        pytest.param({"min_groups": 0}, "min_groups=0", id="minimum"),
        pytest.param({"ready": -1}, "ready=-1", id="ready"),
    ],
)
def test_plan_fixed_chunk_rejects_like_plan_chunk(override: dict[str, int], message: str) -> None:
    args = {"ready": 3, "remaining": 8, "min_groups": 2, "alignment": 1} | override
    with pytest.raises(ValueError, match=message):
        plan_fixed_chunk(**args)


def _fixed(**settings: Any) -> InOrderSampler:
    return InOrderSampler(max_lookahead_versions=0, fixed_chunks=True, **settings)


def _select(sampler: InOrderSampler, remaining: int, *, min_groups: int = 4, align: int = 1) -> Any:
    return sampler.select(
        trainer_step=0,
        trainer_version=0,
        remaining=remaining,
        min_groups=min_groups,
        alignment=align,
    )


def test_blocks_are_released_in_order_only_when_complete() -> None:
    sampler = _fixed()  # batch 10, minimum 4: blocks [0..3], [4..7], [8, 9]
    for g in range(3):
        sampler.add(g, step=0, weight_version=0)
    assert _select(sampler, 10) == []  # 3 of the first block's 4
    for g in range(3, 9):
        sampler.add(g, step=0, weight_version=0)
    assert _select(sampler, 10) == [0, 1, 2, 3]  # not all 9: the cut is fixed
    assert _select(sampler, 6) == [4, 5, 6, 7]
    assert _select(sampler, 2) == []  # the last block waits for group 9
    assert sampler.num_ready == 1
    sampler.add(9, step=0, weight_version=0)
    assert _select(sampler, 2) == [8, 9]  # the last, partial block (below the minimum)


def test_alignment_is_honoured() -> None:
    sampler = _fixed()
    for g in range(5):
        sampler.add(g, step=0, weight_version=0)
    # minimum 3 with alignment 2: blocks of 4, whatever is ready
    assert _select(sampler, 8, min_groups=3, align=2) == [0, 1, 2, 3]
    assert _select(sampler, 4, min_groups=3, align=2) == []


def test_chunks_do_not_depend_on_when_groups_become_ready() -> None:
    # the caller adds in dispatch order; only how many are ready at each poll varies
    batch, minimum = 24, 5
    expected = fixed_chunk_sizes(batch=batch, min_groups=minimum)
    rng = random.Random(0)
    for _ in range(50):
        sampler, added, chunks = _fixed(), 0, []
        while sum(map(len, chunks)) < batch:
            for g in range(added, min(batch, added + rng.randint(0, 7))):
                sampler.add(g, step=0, weight_version=0)
                added += 1
            while (left := batch - sum(map(len, chunks))) and (
                ids := _select(sampler, left, min_groups=minimum)
            ):
                chunks.append(ids)
        assert [len(c) for c in chunks] == expected
        assert [g for c in chunks for g in c] == list(range(batch))


def test_without_fixed_chunks_the_cuts_follow_readiness() -> None:
    sampler = InOrderSampler(max_lookahead_versions=0)
    for g in range(9):
        sampler.add(g, step=0, weight_version=0)
    assert _select(sampler, 10) == []  # 9 would leave 1 < tail floor 2: deferred
    for g in range(9, 10):
        sampler.add(g, step=0, weight_version=0)
    assert _select(sampler, 10) == list(range(10))  # one chunk, where fixed cuts make three


def test_fixed_chunks_survive_a_checkpoint() -> None:
    sampler = _fixed()
    for g in (0, 1, 2):
        sampler.add(g, step=0, weight_version=0)
    state = json.loads(json.dumps(sampler.state_dict()))
    assert state["settings"] == {"max_lookahead_versions": 0, "fixed_chunks": True}
    restored = _fixed()
    restored.load_state_dict(state)
    restored.add(3, step=0, weight_version=0)
    assert _select(restored, 10) == [0, 1, 2, 3]


def test_config_builds_the_fixed_sampler() -> None:
    config = SamplerConfig.from_mapping(
        {
            "ppo": {"num_prompts_per_step": 16},
            "async_rl": {
                "min_groups_for_streaming_train": 4,
                "deterministic_chunks": True,
                "sampler": {"name": "in_order", "max_lookahead_versions": 0},
            },
        }
    )
    assert config.deterministic_chunks
    sampler = make_sampler(config)
    assert isinstance(sampler, InOrderSampler) and sampler.fixed_chunks
    default = make_sampler(SamplerConfig(num_prompts_per_step=16, min_groups_for_streaming_train=4))
    assert isinstance(default, InOrderSampler) and not default.fixed_chunks


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param(
            {"max_lookahead_versions": 1},
            r"async_rl.deterministic_chunks=true needs async_rl.sampler.max_lookahead_versions=0, "
            r"not 1 .*; set async_rl.sampler.max_lookahead_versions=0, or "
            r"async_rl.deterministic_chunks=false",
            id="lookahead",
        ),
        pytest.param(
            {"name": "ready_first", "max_lookahead_versions": 0},
            r"async_rl.deterministic_chunks=true needs async_rl.sampler.name=in_order, not "
            r"'ready_first' .*; set async_rl.sampler.name=in_order, or "
            r"async_rl.deterministic_chunks=false",
            id="ready-first",
        ),
        pytest.param(
            {"deterministic_chunks": "yes"},
            "async_rl.deterministic_chunks='yes' must be true or false",
            id="not-bool",
        ),
    ],
)
def test_config_refuses_what_cannot_be_deterministic(
    override: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {
        "num_prompts_per_step": 16,
        "min_groups_for_streaming_train": 4,
        "deterministic_chunks": True,
        "max_lookahead_versions": 0,
    }
    with pytest.raises(ValueError, match=message):
        SamplerConfig(**(args | override))


def test_fixed_chunks_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="fixed_chunks=1 must be a bool"):
        InOrderSampler(fixed_chunks=1)  # type: ignore[arg-type]
