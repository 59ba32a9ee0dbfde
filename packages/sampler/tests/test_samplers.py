"""The stateful samplers, their config and the demo entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from ppo_sampler import (
    InOrderSampler,
    ReadyFirstSampler,
    Sampler,
    SamplerConfig,
    make_sampler,
)
from ppo_sampler.__main__ import main

GATE = {"min_groups": 32, "alignment": 1}


def _fill(sampler: Sampler, ids: range, *, step: int = 0, version: int = 0) -> None:
    for group_id in ids:
        sampler.add(group_id, step=step, weight_version=version)


# -- in_order --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lookahead", "trainer_step", "allowed"),
    [
        pytest.param(1, 5, [5, 6], id="lookahead-1"),
        pytest.param(0, 5, [5], id="lookahead-0-synchronous"),
        pytest.param(3, 0, [0, 1, 2, 3], id="lookahead-3"),
    ],
)
def test_in_order_lookahead_bound(lookahead: int, trainer_step: int, allowed: list[int]) -> None:
    sampler = InOrderSampler(max_lookahead_versions=lookahead)
    got = [s for s in range(10) if sampler.can_dispatch(s, trainer_step=trainer_step)]
    assert got == allowed


def test_in_order_only_the_current_step_is_eligible() -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(100, 164), step=1)  # next step, generated ahead
    _fill(sampler, range(20), step=0)
    assert sampler.select(trainer_step=0, trainer_version=0, remaining=128, **GATE) == []
    _fill(sampler, range(20, 88), step=0)
    chunk = sampler.select(trainer_step=0, trainer_version=0, remaining=128, **GATE)
    assert chunk == list(range(88))


def test_deferred_groups_stay_ready_and_unclaimed() -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(88))
    assert len(sampler.select(trainer_step=0, trainer_version=0, remaining=128, **GATE)) == 88
    _fill(sampler, range(88, 120))
    # 32 ready of 40 remaining would leave 8 < 16: defer
    assert sampler.select(trainer_step=0, trainer_version=0, remaining=40, **GATE) == []
    assert sampler.num_ready == 32
    assert sampler.claimed() == list(range(88))
    _fill(sampler, range(120, 128))
    final = sampler.select(trainer_step=0, trainer_version=0, remaining=40, **GATE)
    assert final == list(range(88, 128))  # the deferred 32 came back, in order, with 8 more


def test_release_claim_puts_groups_back_in_front_in_order() -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(50))
    chunk = sampler.select(trainer_step=0, trainer_version=0, remaining=50, min_groups=8)
    assert chunk == list(range(50))
    sampler.release_claim(chunk[:10])
    _fill(sampler, range(50, 60))
    assert sampler.claimed() == list(range(10, 50))
    again = sampler.select(trainer_step=0, trainer_version=0, remaining=20, min_groups=8)
    assert again == list(range(10)) + list(range(50, 60))


def test_no_group_is_returned_twice() -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(64))
    first = sampler.select(trainer_step=0, trainer_version=0, remaining=128, **GATE)
    assert sampler.select(trainer_step=0, trainer_version=0, remaining=128 - 64, **GATE) == []
    sampler.mark_consumed(first)
    with pytest.raises(ValueError, match="group 0 is not claimed"):
        sampler.mark_consumed([0])
    assert sampler.num_ready == 0 and sampler.claimed() == []


@pytest.mark.parametrize(
    ("state", "message"),
    [
        pytest.param("ready", "group 3 is already in the sampler", id="ready"),
        pytest.param("claimed", "group 3 is already in the sampler", id="claimed"),
    ],
)
def test_add_rejects_a_live_duplicate(state: str, message: str) -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(4))
    if state == "claimed":
        sampler.select(trainer_step=0, trainer_version=0, remaining=4, min_groups=1)
    with pytest.raises(ValueError, match=message):
        sampler.add(3, step=0, weight_version=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param("mark_consumed", "group 99 is not claimed", id="consume-unknown"),
        pytest.param("release_claim", "group 99 is not claimed", id="release-unknown"),
    ],
)
def test_consume_and_release_are_all_or_nothing(call: str, message: str) -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(4))
    sampler.select(trainer_step=0, trainer_version=0, remaining=4, min_groups=1)
    with pytest.raises(ValueError, match=message):
        getattr(sampler, call)([0, 1, 99])
    with pytest.raises(ValueError, match="listed twice"):
        getattr(sampler, call)([2, 2])
    assert sampler.claimed() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"group_id": 1.5}, "group_id=1.5", id="float-id"),
        pytest.param({"step": -1}, "step=-1", id="negative-step"),
        pytest.param({"weight_version": -2}, "weight_version=-2", id="negative-version"),
    ],
)
def test_add_validates(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"group_id": 1, "step": 0, "weight_version": 0} | kwargs
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        InOrderSampler().add(args.pop("group_id"), **args)


def test_select_validates_before_changing_state() -> None:
    sampler = ReadyFirstSampler(max_staleness_versions=0, evict_stale=True)
    _fill(sampler, range(4), version=0)
    with pytest.raises(ValueError, match="remaining=0"):
        sampler.select(trainer_step=0, trainer_version=3, remaining=0, min_groups=1)
    assert sampler.pop_evicted() == []  # no eviction happened
    assert sampler.state_dict()["trainer_version"] is None
    with pytest.raises(ValueError, match="trainer_step=-1"):
        InOrderSampler().select(trainer_step=-1, trainer_version=0, remaining=4, min_groups=1)


def test_in_order_reports_groups_left_behind() -> None:
    sampler = InOrderSampler()
    sampler.add("old", step=0, weight_version=0)
    sampler.add("now", step=1, weight_version=1)
    assert sampler.stale() == []  # nothing selected yet: no trainer position known
    assert sampler.select(trainer_step=1, trainer_version=1, remaining=1, min_groups=1) == ["now"]
    assert sampler.stale() == ["old"]


def test_string_ids_work() -> None:
    sampler = InOrderSampler()
    sampler.add("p7/g0", step=0, weight_version=0)
    assert sampler.select(trainer_step=0, trainer_version=0, remaining=1, min_groups=1) == ["p7/g0"]


# -- ready_first -----------------------------------------------------------------------


def test_ready_first_takes_any_fresh_group_oldest_first() -> None:
    sampler = ReadyFirstSampler(max_staleness_versions=1)
    sampler.add("v2", step=2, weight_version=2)
    sampler.add("v1", step=0, weight_version=1)
    sampler.add("v0", step=0, weight_version=0)
    chunk = sampler.select(trainer_step=2, trainer_version=2, remaining=2, min_groups=1)
    assert chunk == ["v1", "v2"]  # v0 is 2 versions behind: not eligible
    assert sampler.stale() == ["v0"]
    assert sampler.pop_evicted() == []
    assert sampler.num_ready == 1


def test_ready_first_evicts_only_when_configured() -> None:
    sampler = ReadyFirstSampler(max_staleness_versions=0, evict_stale=True)
    _fill(sampler, range(3), version=0)
    _fill(sampler, range(3, 5), version=1)
    chunk = sampler.select(trainer_step=1, trainer_version=1, remaining=2, min_groups=1)
    assert chunk == [3, 4]
    assert sampler.stale() == []
    assert sampler.num_ready == 0
    assert sampler.pop_evicted() == [0, 1, 2]
    assert sampler.pop_evicted() == []
    sampler.add(0, step=1, weight_version=1)  # the re-dispatched prompt may reuse its id


def test_ready_first_stale_groups_stay_out_of_the_count() -> None:
    """Stale groups must not make an incomplete step look complete."""
    sampler = ReadyFirstSampler(max_staleness_versions=1)
    _fill(sampler, range(100), version=0)
    _fill(sampler, range(100, 120), version=5)
    assert sampler.select(trainer_step=5, trainer_version=5, remaining=128, **GATE) == []
    assert len(sampler.stale()) == 100


@pytest.mark.parametrize(
    ("staleness", "trainer_step", "allowed"),
    [pytest.param(0, 4, [4], id="on-policy"), pytest.param(2, 4, [4, 5, 6], id="two-ahead")],
)
def test_ready_first_dispatch_bound(staleness: int, trainer_step: int, allowed: list[int]) -> None:
    sampler = ReadyFirstSampler(max_staleness_versions=staleness)
    assert [s for s in range(10) if sampler.can_dispatch(s, trainer_step=trainer_step)] == allowed


# -- checkpoints -----------------------------------------------------------------------


def _busy(sampler: Sampler) -> None:
    _fill(sampler, range(10), step=0, version=0)
    _fill(sampler, range(10, 20), step=1, version=1)
    _fill(sampler, range(20, 25), step=2, version=3)
    sampler.add("s", step=0, weight_version=0)
    sampler.select(trainer_step=0, trainer_version=3, remaining=11, min_groups=4)


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: InOrderSampler(max_lookahead_versions=2), id="in_order"),
        pytest.param(
            lambda: ReadyFirstSampler(max_staleness_versions=1, evict_stale=True), id="evict"
        ),
        pytest.param(lambda: ReadyFirstSampler(max_staleness_versions=1), id="ready_first"),
    ],
)
def test_state_round_trips_through_json(factory: Any) -> None:
    original: Sampler = factory()
    _busy(original)
    state = json.loads(json.dumps(original.state_dict()))
    restored: Sampler = factory()
    restored.add("junk", step=0, weight_version=0)  # replaced by the load
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert restored.claimed() == original.claimed() != []
    assert restored.stale() == original.stale()
    assert restored.pop_evicted() == original.pop_evicted()
    # both behave identically afterwards
    for sampler in (original, restored):
        sampler.mark_consumed(sampler.claimed())
    args = {"trainer_step": 1, "trainer_version": 3, "remaining": 10, "min_groups": 1}
    assert restored.select(**args) == original.select(**args)
    assert restored.state_dict() == original.state_dict()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(lambda s: s.update(name="ready_first"), "async_rl.sampler.name", id="name"),
        pytest.param(lambda s: s.update(format=7), "unknown state format 7", id="format"),
        pytest.param(lambda s: s.pop("claimed"), "malformed snapshot", id="missing-key"),
        pytest.param(lambda s: s["ready"].append([1, 0, 0]), "appears twice", id="duplicate"),
        pytest.param(lambda s: s["ready"].append([99, -1, 0]), "step=-1", id="bad-step"),
        pytest.param(lambda s: s["ready"].append("x"), "malformed group row", id="bad-row"),
    ],
)
def test_load_state_dict_rejects_bad_snapshots(mutate: Any, message: str) -> None:
    sampler = InOrderSampler()
    _fill(sampler, range(4))
    state = sampler.state_dict()
    mutate(state)
    target = InOrderSampler()
    target.add("keep", step=0, weight_version=0)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert target.state_dict()["ready"] == [["keep", 0, 0]]  # unchanged on failure


# -- config ----------------------------------------------------------------------------

DOC_CONFIG: dict[str, Any] = {
    "ppo": {"num_prompts_per_step": 256, "ppo_epochs": 1, "critic_ppo_epochs": 2},
    "async_rl": {
        "min_groups_for_streaming_train": 32,
        "sampler": {"name": "in_order", "max_lookahead_versions": 1},
    },
}


def test_config_reads_the_document_example() -> None:
    config = SamplerConfig.from_mapping(DOC_CONFIG)
    assert config == SamplerConfig(
        num_prompts_per_step=256,
        min_groups_for_streaming_train=32,
        name="in_order",
        max_lookahead_versions=1,
    )
    assert not config.full_batch
    sampler = make_sampler(config)
    assert isinstance(sampler, InOrderSampler)
    assert sampler.max_lookahead_versions == 1


def test_config_without_minimum_is_full_batch() -> None:
    config = SamplerConfig.from_mapping({"ppo": {"num_prompts_per_step": 64}})
    assert config.min_groups_for_streaming_train == 64
    assert config.full_batch


def test_make_sampler_ready_first() -> None:
    config = SamplerConfig(
        num_prompts_per_step=8,
        min_groups_for_streaming_train=4,
        name="ready_first",
        max_staleness_versions=3,
        evict_stale=True,
    )
    sampler = make_sampler(config)
    assert isinstance(sampler, ReadyFirstSampler)
    assert (sampler.max_staleness_versions, sampler.evict_stale) == (3, True)


BAD_CONFIGS = [
    pytest.param({"name": "fifo"}, "async_rl.sampler.name='fifo'", id="name"),
    pytest.param({"num_prompts_per_step": 0}, "ppo.num_prompts_per_step=0", id="batch"),
    pytest.param(
        {"min_groups_for_streaming_train": 0},
        "async_rl.min_groups_for_streaming_train=0",
        id="min-zero",
    ),
    pytest.param(
        {"min_groups_for_streaming_train": 300},
        "async_rl.min_groups_for_streaming_train=300 exceeds",
        id="min-above-batch",
    ),
    pytest.param(
        {"max_lookahead_versions": -1}, "async_rl.sampler.max_lookahead_versions=-1", id="ahead"
    ),
    pytest.param(
        {"max_staleness_versions": "2"}, "async_rl.sampler.max_staleness_versions='2'", id="stale"
    ),
    pytest.param({"evict_stale": "yes"}, "async_rl.sampler.evict_stale='yes'", id="evict"),
]


@pytest.mark.parametrize(("override", "message"), BAD_CONFIGS)
def test_config_names_the_bad_key(override: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"num_prompts_per_step": 256, "min_groups_for_streaming_train": 32}
    with pytest.raises(ValueError, match=message):
        SamplerConfig(**(args | override))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param(
            {"ppo": {"num_prompts_per_step": 8}, "async_rl": {"sampler": {"lookahead": 1}}},
            "async_rl.sampler.lookahead is not a sampler setting",
            id="unknown-key",
        ),
        pytest.param({"async_rl": {}}, "ppo.num_prompts_per_step is required", id="no-batch"),
        pytest.param(
            {"ppo": {"num_prompts_per_step": 8}, "async_rl": {"sampler": "in_order"}},
            "async_rl.sampler must be a mapping",
            id="not-mapping",
        ),
    ],
)
def test_from_mapping_names_the_bad_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplerConfig.from_mapping(config)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        pytest.param(
            lambda: InOrderSampler(max_lookahead_versions=-1),
            "max_lookahead_versions=-1",
            id="lookahead",
        ),
        pytest.param(
            lambda: ReadyFirstSampler(max_staleness_versions=-1),
            "max_staleness_versions=-1",
            id="staleness",
        ),
        pytest.param(
            lambda: ReadyFirstSampler(evict_stale=1),  # type: ignore[arg-type]
            "evict_stale=1",
            id="evict",
        ),
    ],
)
def test_sampler_constructors_validate(factory: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


# -- demo ------------------------------------------------------------------------------


def test_demo_prints_the_document_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "chunks: 88 + 40 = 128" in out
    assert "would leave 8 < tail floor 16" in out
    assert "mode: streaming" in out


def test_demo_min_86_is_one_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--min-groups", "86", "--polls", "90,128"]) == 0
    out = capsys.readouterr().out
    assert "chunks: 128 = 128" in out
    assert "mode: one chunk per step (single_chunk_only=True)" in out


def test_demo_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ppo_sampler", "--polls", "50,113,128"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "chunks: 50 + 78 = 128" in done.stdout


def test_demo_rejects_bad_polls() -> None:
    with pytest.raises(SystemExit):
        main(["--polls", "5,3,128"])


def test_problems_lists_every_refused_field_without_building() -> None:
    from ppo_sampler import SamplerConfigError

    values: dict[str, Any] = {
        "num_prompts_per_step": 16,
        "min_groups_for_streaming_train": 17,
        "name": "fifo",
        "max_lookahead_versions": -1,
        "max_staleness_versions": -2,
        "evict_stale": "yes",
    }
    problems = SamplerConfig.problems(**values)
    assert [p.field for p in problems] == [
        "name",
        "min_groups_for_streaming_train",
        "max_lookahead_versions",
        "max_staleness_versions",
        "evict_stale",
    ]
    assert all(p.fix for p in problems)
    assert problems[1].value == 17 and "exceeds ppo.num_prompts_per_step=16" in problems[1].message
    with pytest.raises(SamplerConfigError) as info:
        SamplerConfig(**values)
    assert info.value.problems == problems
    assert SamplerConfig.problems(num_prompts_per_step=16, min_groups_for_streaming_train=4) == []


def test_in_order_stale_lists_only_groups_of_earlier_steps() -> None:
    """A ready group of the step being trained is not stale, even while the gate holds
    it back (fewer ready than the minimum); one of an earlier step is."""
    sampler = InOrderSampler(max_lookahead_versions=0)
    _fill(sampler, range(5), step=0)
    assert sampler.select(trainer_step=0, trainer_version=0, remaining=10, min_groups=8) == []
    assert sampler.stale() == []
    _fill(sampler, range(5, 13), step=1)
    assert sampler.select(trainer_step=1, trainer_version=1, remaining=8, min_groups=8) == list(
        range(5, 13)
    )
    assert sampler.stale() == [0, 1, 2, 3, 4]  # left behind by step 0


@pytest.mark.parametrize("name", ["in_order", "ready_first"])
def test_a_consumed_group_is_forgotten(name: str) -> None:
    """After ``mark_consumed`` the sampler keeps nothing of a group: ``info`` no longer
    knows it, and its id may come back (as an evicted one's may)."""
    sampler = make_sampler(
        SamplerConfig(num_prompts_per_step=1, min_groups_for_streaming_train=1, name=name)
    )
    sampler.add("a", step=0, weight_version=0)
    assert sampler.select(trainer_step=0, trainer_version=0, remaining=1, min_groups=1) == ["a"]
    sampler.mark_consumed(["a"])
    with pytest.raises(KeyError):
        sampler.info("a")
    sampler.add("a", step=1, weight_version=1)
    assert sampler.info("a") == (1, 1)


def test_fixed_blocks_with_ready_first_get_one_problem_naming_the_sampler() -> None:
    """``max_lookahead_versions`` is an ``in_order`` setting: with ``ready_first`` the
    fix is the sampler's name, not the look-ahead."""
    problems = SamplerConfig.problems(
        num_prompts_per_step=8,
        min_groups_for_streaming_train=4,
        name="ready_first",
        deterministic_chunks=True,
    )
    assert [p.field for p in problems] == ["deterministic_chunks"]
    assert "async_rl.sampler.name=in_order" in problems[0].fix
