"""Hypothesis properties of the chunk gate and of the samplers driven like the driver."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_sampler import (
    GroupId,
    InOrderSampler,
    ReadyFirstSampler,
    chunk_schedule,
    plan_chunk,
    tail_floor,
)

settings.register_profile("ppo_sampler", max_examples=150, deadline=None)
settings.load_profile("ppo_sampler")


@dataclass(frozen=True)
class Step:
    batch: int
    low: int
    alignment: int
    polls: list[int]


@st.composite
def steps(draw: st.DrawFn) -> Step:
    alignment = draw(st.integers(1, 8))
    batch = alignment * draw(st.integers(1, 40))
    low = draw(st.integers(1, batch))
    counts = draw(st.lists(st.integers(0, batch), max_size=12))
    return Step(batch, low, alignment, [*sorted(counts), batch])


@given(steps())
def test_schedule_sums_to_batch_and_respects_the_gate(step: Step) -> None:
    chunks = chunk_schedule(
        step.polls, batch=step.batch, min_groups=step.low, alignment=step.alignment
    )
    assert sum(chunks) == step.batch
    assert all(size > 0 and size % step.alignment == 0 for size in chunks)
    left = step.batch
    floor = tail_floor(min_groups=step.low)
    for size in chunks[:-1]:
        left -= size
        assert size >= step.low
        assert left >= floor


@given(steps())
def test_schedule_never_trains_unfinished_groups(step: Step) -> None:
    """Each chunk fits in what has finished by its poll (replayed independently)."""
    chunks = iter(
        chunk_schedule(step.polls, batch=step.batch, min_groups=step.low, alignment=step.alignment)
    )
    consumed = 0
    for finished in step.polls:
        while consumed < step.batch:
            size = plan_chunk(
                ready=finished - consumed,
                remaining=step.batch - consumed,
                min_groups=step.low,
                alignment=step.alignment,
            )
            if size == 0:
                break
            assert size == next(chunks)
            assert consumed + size <= finished
            consumed += size
    assert next(chunks, None) is None


@given(
    alignment=st.integers(1, 8),
    units=st.integers(1, 64),
    low=st.integers(1, 600),
    ready=st.integers(0, 600),
)
def test_plan_chunk_defers_rather_than_trims(
    alignment: int, units: int, low: int, ready: int
) -> None:
    remaining = alignment * units
    got = plan_chunk(ready=ready, remaining=remaining, min_groups=low, alignment=alignment)
    if ready >= remaining:
        assert got == remaining
        return
    largest = ready - ready % alignment
    assert got in (0, largest)  # never a trimmed selection
    left = remaining - largest
    allowed = largest >= low and not 0 < left < tail_floor(min_groups=low)
    assert got == (largest if allowed else 0)


@given(steps(), st.randoms(use_true_random=False))
def test_in_order_sampler_claims_every_group_exactly_once(step: Step, rng: random.Random) -> None:
    """Groups finish in random order across two steps; nothing lost, duplicated or late."""
    sampler = InOrderSampler(max_lookahead_versions=1)
    returned: list[GroupId] = []
    for trainer_step in (0, 1):
        ids = [trainer_step * 1000 + i for i in range(step.batch)]
        rng.shuffle(ids)
        added = claimed = 0
        for finished in step.polls:
            for group_id in ids[added:finished]:
                sampler.add(group_id, step=trainer_step, weight_version=trainer_step)
                # generation of the next step runs ahead; it must not leak into this one
                if trainer_step == 0:
                    sampler.add(5000 + group_id, step=9, weight_version=0)
            added = max(added, finished)
            while claimed < step.batch:
                chunk = sampler.select(
                    trainer_step=trainer_step,
                    trainer_version=trainer_step,
                    remaining=step.batch - claimed,
                    min_groups=step.low,
                    alignment=step.alignment,
                )
                if not chunk:
                    break
                assert set(chunk) <= set(ids[:added])
                returned.extend(chunk)
                claimed += len(chunk)
        assert claimed == step.batch  # the final poll never deadlocks
        sampler.mark_consumed(sampler.claimed())
    assert sorted(returned) == sorted(range(step.batch)) + sorted(range(1000, 1000 + step.batch))
    assert sampler.num_ready == step.batch  # the step-9 groups are still there
    assert sampler.claimed() == []


@given(
    versions=st.lists(st.integers(0, 6), min_size=1, max_size=60),
    trainer_version=st.integers(0, 8),
    staleness=st.integers(0, 3),
    evict=st.booleans(),
    low=st.integers(1, 8),
)
def test_ready_first_partitions_groups(
    versions: list[int], trainer_version: int, staleness: int, evict: bool, low: int
) -> None:
    """Every group ends up exactly once: claimed, still ready, or evicted; claims are fresh."""
    sampler = ReadyFirstSampler(max_staleness_versions=staleness, evict_stale=evict)
    for group_id, version in enumerate(versions):
        sampler.add(group_id, step=0, weight_version=version)
    fresh = [g for g, v in enumerate(versions) if trainer_version - v <= staleness]
    stale = [g for g, v in enumerate(versions) if trainer_version - v > staleness]
    remaining = len(versions)
    chunk = sampler.select(
        trainer_step=0, trainer_version=trainer_version, remaining=remaining, min_groups=low
    )
    assert len(chunk) == plan_chunk(ready=len(fresh), remaining=remaining, min_groups=low)
    assert set(chunk) <= set(fresh)
    # oldest eligible versions are claimed first
    claimed_versions = [versions[int(g)] for g in chunk]
    assert claimed_versions == sorted(claimed_versions)
    if chunk:
        assert max(claimed_versions, default=0) <= min(
            (versions[g] for g in fresh if g not in chunk), default=99
        )
    evicted = sampler.pop_evicted()
    assert sorted(evicted) == (sorted(stale) if evict else [])
    assert sorted(sampler.stale()) == ([] if evict else sorted(stale))
    still_ready = sampler.num_ready
    assert len(chunk) + still_ready + len(evicted) == len(versions)
