"""Embedded engines, weight refit and the rollout manager on a real local Ray cluster
(127.0.0.1, one cluster for the module) with tiny real models."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ppo_driver.rollout import (
    CharTokenizer,
    EngineHealth,
    EngineRestarted,
    Evaluator,
    GroupOutput,
    GroupRequest,
    PromptDataset,
    ReplayBuffer,
    RewardFailure,
    RolloutManager,
    SamplingParams,
    WeightRefitter,
    build_batch,
    launch_embedded_engines,
    repeat_reward,
    score_group,
    synthetic_records,
)
from ppo_sampler import InOrderSampler
from ppo_trainer import ActorConfig, ActorWorker, ModelSpec, build_causal_lm
from ppo_trainer.testing import head_magnitude, model_terms, rounding_bound
from ray.exceptions import RayActorError
from test_rollout_safety_ports import is_loopback, listening_sockets, process_tree

TOK = CharTokenizer()
SPEC = ModelSpec(
    vocab_size=TOK.vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    seed=0,
)
PARAMS = SamplingParams(n=4, max_new_tokens=14, stop_token_ids=(TOK.eos_id,))
DATA = PromptDataset(
    [{**r, "id": i} for i, r in enumerate(synthetic_records(num_prompts=64, seed=1, max_count=12))],
    TOK,
)
"""Each record names its prompt ("id"): a reward gets its own copy of the record, so the
rewards below tell prompts apart by that, not by identity."""


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    from ppo_placement import shutdown_local_ray, start_local_ray

    start_local_ray(num_cpus=8)
    yield
    shutdown_local_ray()


@pytest.fixture(scope="module")
def engines() -> list[Any]:
    handles = launch_embedded_engines(2, model=SPEC, run_seed=11, num_cpus=1)
    ray.get([e.health.remote() for e in handles], timeout=300)
    return handles


def _requests(ids: list[int]) -> list[GroupRequest]:
    return [GroupRequest(prompt_index=i, prompt_ids=DATA.prompt_ids(i), params=PARAMS) for i in ids]


def _strip(out: GroupOutput) -> tuple[Any, ...]:
    return (out.prompt_index, out.prompt_ids, out.samples, out.weight_version)


def test_same_seed_different_dispatch_gives_identical_samples(engines: list[Any]) -> None:
    ids = list(range(12))
    together = ray.get(engines[0].generate.remote(_requests(ids)))
    refs = [engines[k % 2].generate.remote(_requests([i])) for k, i in enumerate(reversed(ids))]
    apart = [out for r in refs for out in ray.get(r)][::-1]
    assert [_strip(o) for o in together] == [_strip(o) for o in apart]
    assert {o.engine_id for o in apart} == {"engine-0", "engine-1"}
    lengths = {len(s.token_ids) for o in together for s in o.samples}
    assert len(lengths) >= 4  # lengths genuinely vary


def _check_against_trainer(actor: Any, outputs: list[GroupOutput]) -> float:
    """The largest |engine - trainer| log-prob of the outputs' tokens, as a fraction of the
    float32 rounding bound of a forward (the engine decodes with a KV cache, the trainer
    runs one padded forward): ``rounding_bound`` over ``model_terms`` of SPEC at twice the
    head's magnitude on this batch with the trainer's current weights (a log-prob ``z_y -
    logsumexp(z)`` carries the logits' error twice; ``ppo_trainer.testing``). <= 1: the
    engine holds the trainer's weights; >> 1: other weights."""
    groups = [
        score_group(o, record=DATA.record(o.prompt_index), reward_fn=repeat_reward, tokenizer=TOK)
        for o in outputs
    ]
    batch = build_batch(groups, pad_id=TOK.pad_id)
    trainer = ray.get(actor.compute_logprobs.remote(batch))
    mask = batch["loss_mask"].bool()
    diff = float((trainer[mask].double() - batch["engine_logprobs"][mask].double()).abs().max())
    model = build_causal_lm(SPEC)
    model.load_state_dict(ray.get(actor.export_weights.remote()))
    terms = model_terms(
        SPEC, tokens=batch["input_ids"].numel(), seq_len=batch["input_ids"].shape[1], backward=False
    )
    bound = rounding_bound(terms=terms, magnitude=2 * head_magnitude(model, batch))
    print(f"engine vs trainer log-probs: |diff| {diff:.3g}, bound {bound:.3g}")
    return diff / bound


def test_refit_makes_engines_match_the_trainer(engines: list[Any], tmp_path: Path) -> None:
    actor: Any = ray.remote(ActorWorker).options(num_cpus=1).remote(ActorConfig(model=SPEC))
    reqs = _requests([20, 21, 22])
    before = ray.get(engines[0].generate.remote(reqs))
    assert _check_against_trainer(actor, before) <= 1  # same spec, same weights

    weights = ray.get(actor.export_weights.remote())
    gen = torch.Generator().manual_seed(5)
    ray.get(
        actor.load_weights.remote(
            {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        )
    )
    assert _check_against_trainer(actor, before) > 1  # the trainer moved on: beyond rounding

    refitter = WeightRefitter(actor=actor, engines=engines, backend="gloo", bucket_bytes=8192)
    stats = refitter.refit(version=1)
    assert stats.buckets > 1 and stats.bytes == sum(v.numel() * 4 for v in weights.values())
    after = [ray.get(e.generate.remote(reqs)) for e in engines]
    assert [_strip(o) for o in after[0]] == [_strip(o) for o in after[1]]
    assert all(o.weight_version == 1 for o in after[0])
    assert [o.samples for o in after[0]] != [o.samples for o in before]
    assert _check_against_trainer(actor, after[0]) <= 1

    # a second refit over the same group, then the safetensors fallback
    assert refitter.refit(version=2).version == 2
    ray.get(actor.load_weights.remote(weights))
    disk = refitter.refit_from_disk(version=3, path=tmp_path / "w")
    assert disk.transport == "disk"
    back = ray.get(engines[1].generate.remote(reqs))
    assert all(o.weight_version == 3 for o in back)
    assert _check_against_trainer(actor, back) <= 1
    # the original weights under a new version: a new random stream, same distribution
    assert [o.samples for o in back] != [o.samples for o in before]
    ray.kill(actor)


def test_pause_waits_for_the_running_group_and_blocks_new_ones(engines: list[Any]) -> None:
    e = engines[1]
    ray.get(e.set_step_delay.remote(0.02))
    served = ray.get(e.health.remote()).groups_served
    running = e.generate.remote(_requests([30]))
    deadline = time.monotonic() + 60
    while ray.get(e.health.remote()).extra["busy"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray.get(e.pause_generation.remote())
    # pause returned only after the running group finished
    assert ray.get(e.health.remote()).groups_served == served + 1
    assert ray.get(running, timeout=30)[0].prompt_index == 30
    blocked = e.generate.remote(_requests([31]))
    done, _ = ray.wait([blocked], timeout=1.0)
    assert not done and ray.get(e.health.remote()).paused
    ray.get(e.continue_generation.remote())
    assert ray.get(blocked, timeout=60)[0].prompt_index == 31
    ray.get(e.set_step_delay.remote(0.0))
    ray.get(e.release_memory.remote())
    assert ray.get(e.health.remote()).memory_released
    ray.get(e.resume_memory.remote())


def test_progress_bounds_each_running_groups_longest_response_from_below(
    engines: list[Any],
) -> None:
    """``progress()``, asked while a round decodes (a control thread): every group out
    that it lists has drawn fewer tokens than its longest response will have, the
    counts grow, a group that finished is not listed, and nothing is once all are back
    (what ``async_rl.block_order: length`` files by)."""
    e = engines[0]
    ray.get(e.set_step_delay.remote(0.02))
    width = len(DATA.prompt_ids(40))
    ids = [i for i in range(40, 64) if len(DATA.prompt_ids(i)) == width][:5]
    refs = {i: e.generate.remote(_requests([i])) for i in ids}
    reports: list[tuple[dict[int, int], set[int]]] = []
    deadline = time.monotonic() + 120
    while True:
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        report = ray.get(e.progress.remote())
        reports.append((report, {i for i, r in refs.items() if r in done}))
        if len(done) == len(refs):
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ray.get(e.set_step_delay.remote(0.0))
    longest = {i: max(len(s.token_ids) for s in ray.get(r)[0].samples) for i, r in refs.items()}
    assert reports[-1][0] == {} == ray.get(e.progress.remote())
    assert any(d > 0 for report, _ in reports for d in report.values())  # seen mid-round
    last: dict[int, int] = {}
    for report, back in reports:
        assert not back & set(report)  # back before the report was asked: not listed
        for i, drawn in report.items():
            assert drawn < longest[i], (i, drawn, longest[i])
            assert drawn >= last.get(i, 0)
            last[i] = drawn


def test_calls_sent_together_share_a_round_and_short_groups_return_first(
    engines: list[Any],
) -> None:
    """Continuous-batching-like engine: single-group calls sent together decode as one
    batch, and a group returns as soon as its own samples are done (the long tail)."""
    e = engines[0]
    ray.get([e.set_step_delay.remote(0.02), e.set_gather_window.remote(1.0)])
    before = ray.get(e.health.remote()).extra["rounds"]
    short = dataclasses.replace(PARAMS, max_new_tokens=2)
    width = len(DATA.prompt_ids(40))  # a round holds prompts of one length (no padding)
    reqs = _requests([i for i in range(40, 64) if len(DATA.prompt_ids(i)) == width][:5])
    reqs[2] = dataclasses.replace(reqs[2], params=short)
    refs = [e.generate.remote([r]) for r in reqs]
    (first,), _ = ray.wait(refs, num_returns=1, timeout=120)
    health = ray.get(e.health.remote())
    outs = [ray.get(r, timeout=120)[0] for r in refs]
    ray.get([e.set_step_delay.remote(0.0), e.set_gather_window.remote(0.05)])
    assert first == refs[2]  # the short group came back first ...
    assert health.extra["rounds"] - before == 1  # ... from the one round of all five ...
    assert health.extra["busy"] == 5  # ... which went on decoding the long ones
    assert max(len(s.token_ids) for s in outs[2].samples) <= 2
    assert max(len(s.token_ids) for o in outs for s in o.samples) > 2
    # batching changed nothing: the same samples as one call per group, one at a time
    alone = [ray.get(e.generate.remote([r]))[0] for r in reqs]
    assert [_strip(o) for o in outs] == [_strip(o) for o in alone]


def _manager(engines: list[Any], sampler: InOrderSampler, **kw: Any) -> RolloutManager:
    opts: dict[str, Any] = {
        "dataset": DATA,
        "reward_fn": repeat_reward,
        "params": PARAMS,
        "prompts_per_step": 4,
        "max_in_flight": 3,
    }
    opts.update(kw)
    return RolloutManager(engines=engines, sampler=sampler, **opts)


def _run_until(m: RolloutManager, cond: Any, *, trainer_step: int, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "rollout did not finish in time"
        m.pump(trainer_step=trainer_step, timeout_s=0.2)


def test_lookahead_and_in_flight_bounds(engines: list[Any]) -> None:
    sampler = InOrderSampler(max_lookahead_versions=1)
    m = _manager(engines, sampler, max_in_flight=3)
    _run_until(m, lambda: m.idle() and len(m.buffer) == 8, trainer_step=0)
    for _ in range(3):
        m.pump(trainer_step=0, timeout_s=0.1)
    assert m.max_step_dispatched == 1 and len(m.buffer) == 8  # steps 0 and 1 only
    assert m.peak_in_flight <= 3 and set(m.dispatch_counts.values()) == {1}
    ids = sampler.select(trainer_step=0, trainer_version=0, remaining=4, min_groups=4)
    assert sorted(ids) == [0, 1, 2, 3]
    batch = m.claim(ids)
    assert batch["input_ids"].shape[0] == 16 and batch["sample_rewards"].shape == (16,)
    m.release(ids)
    _run_until(m, lambda: len(m.buffer) == 8 and m.idle(), trainer_step=1)
    assert m.max_step_dispatched == 2 and sorted(m.buffer.ready_ids()) == list(range(4, 12))


def test_a_poll_also_ends_when_a_call_to_wake_on_ends(engines: list[Any]) -> None:
    """``pump(wake_on=...)``: the driver waits for generation and for another call (a
    trainer's) at once, returning as soon as either is done."""
    ray.get([e.set_step_delay.remote(0.3) for e in engines])  # a group takes >= 0.3 s
    try:
        m = _manager(engines, InOrderSampler(max_lookahead_versions=0))
        other = ray.put("done")  # another call that has ended
        assert m.pump(trainer_step=0, timeout_s=120, wake_on=[other]) == []
        assert m.groups_in_flight == 3  # nothing back yet: the poll did not wait for it
        ready = m.pump(trainer_step=0, timeout_s=120)  # without: waits for a group
        assert ready and m.groups_in_flight + len(ready) <= 4
    finally:
        ray.get([e.set_step_delay.remote(0.0) for e in engines])
    _run_until(m, lambda: m.idle() and len(m.buffer) == 4, trainer_step=0)


def _flaky_reward(*, response: str, record: Any, finish_reason: str) -> float:
    if record["id"] == 2:
        raise ZeroDivisionError("the grader crashed")
    if record["id"] == 5:
        return float("nan")
    return repeat_reward(response=response, record=record, finish_reason=finish_reason)


def test_bad_rewards_fail_their_group_and_the_step_is_refilled(engines: list[Any]) -> None:
    sampler = InOrderSampler(max_lookahead_versions=0)
    m = _manager(engines, sampler, reward_fn=_flaky_reward, groups_per_call=2)
    _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=0)
    assert [(f.group_id, f.step) for f in m.failures] == [(2, 0)]
    assert "ZeroDivisionError: the grader crashed" in m.failures[0].message
    assert sorted(m.buffer.ready_ids()) == [0, 1, 3, 4]  # prompt 4 took the failed one's place
    ids = sampler.select(trainer_step=0, trainer_version=0, remaining=4, min_groups=4)
    m.claim(ids)
    m.release(ids)
    _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=1)
    assert [(f.group_id, f.step) for f in m.failures] == [(2, 0), (5, 1)]
    assert "returned nan for prompt 5 sample 0; a reward must return a real number" in (
        m.failures[1].message
    )
    assert sorted(m.buffer.ready_ids()) == [6, 7, 8, 9] and sampler.num_ready == 4
    assert 2 not in m.buffer and 5 not in m.buffer


def test_a_reward_that_edits_its_record_changes_neither_the_data_nor_other_calls(
    engines: list[Any],
) -> None:
    """Training's groups and evaluation each pass the reward a record of its own: the
    edits of one call reach no other call and not the data set."""
    records = [{**r, "tags": ["stored"]} for r in synthetic_records(num_prompts=8, seed=3)]
    stored = copy.deepcopy(records)
    data = PromptDataset(records, TOK)
    seen: list[dict[str, Any]] = []

    def editing_reward(*, response: str, record: dict[str, Any], finish_reason: str) -> float:
        seen.append(copy.deepcopy(record))
        record["tags"].append("edited")
        record["count"] = 99
        return repeat_reward(response=response, record=record, finish_reason=finish_reason)

    m = _manager(engines, InOrderSampler(max_lookahead_versions=0), dataset=data,
                 reward_fn=editing_reward)  # fmt: skip
    _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=0)
    assert len(seen) == 4 * PARAMS.n and not m.failures
    assert all(r in stored for r in seen), "a call saw an earlier call's edit"
    evaluated = Evaluator(
        engines=engines, dataset=data, reward_fn=editing_reward, max_new_tokens=6,
        stop_token_ids=(TOK.eos_id,),
    ).run()  # fmt: skip
    assert evaluated.failures == 0 and len(seen) == 4 * PARAMS.n + len(records)
    assert all(r in stored for r in seen), "a call saw an earlier call's edit"
    assert records == stored  # the data set is as loaded


def test_checkpoint_with_groups_in_flight_loses_and_duplicates_nothing(
    engines: list[Any], tmp_path: Path
) -> None:
    ref_sampler = InOrderSampler(max_lookahead_versions=1)
    ref = _manager(engines, ref_sampler)
    _run_until(ref, lambda: ref.idle() and len(ref.buffer) == 8, trainer_step=0)

    sampler = InOrderSampler(max_lookahead_versions=1)
    a = _manager(engines, sampler)
    _run_until(a, lambda: len(a.buffer) >= 2 and a.groups_in_flight > 0, trainer_step=0)
    ids = sampler.select(trainer_step=0, trainer_version=0, remaining=4, min_groups=1)
    a.claim(ids)  # claimed but not released: the update never completed
    a.save(tmp_path)
    sampler_state = sampler.state_dict()
    in_flight = set(a.in_flight_ids())
    buffered = set(a.buffer.ready_ids()) | set(a.buffer.claimed_ids())
    assert in_flight and buffered

    sampler2 = InOrderSampler(max_lookahead_versions=1)
    sampler2.load_state_dict(sampler_state)
    sampler2.release_claim(sampler2.claimed())
    b = _manager(engines, sampler2, buffer=ReplayBuffer())
    b.load(tmp_path)
    _run_until(b, lambda: b.idle() and len(b.buffer) == 8, trainer_step=0)
    assert sorted(b.buffer.ready_ids()) == list(range(8))
    assert all(b.dispatch_counts[g] == 1 for g in in_flight)
    assert set(b.dispatch_counts.values()) == {1}
    assert not set(b.dispatch_counts) & buffered  # buffered groups are not generated again
    for g in range(8):  # which engine served a group does not matter
        assert _strip(b.buffer.get(g).output) == _strip(ref.buffer.get(g).output)
        assert b.buffer.get(g).rewards == ref.buffer.get(g).rewards
    assert sampler2.num_ready == 8


def test_engine_death_mid_step_loses_nothing(tmp_path: Path) -> None:
    (engine,) = launch_embedded_engines(
        1, model=SPEC, run_seed=11, num_cpus=1, name_prefix="victim"
    )
    holder: Any = ray.remote(ActorWorker).options(num_cpus=0).remote(ActorConfig(model=SPEC))
    weights = ray.get(holder.export_weights.remote())
    ray.get(holder.load_weights.remote({k: v * 1.1 for k, v in weights.items()}))
    refitter = WeightRefitter(actor=holder, engines=[engine], snapshot_dir=tmp_path / "snap")
    refitter.refit(version=4)
    first = ray.get(engine.health.remote(), timeout=300)
    ray.get(engine.set_step_delay.remote(0.03))
    sampler = InOrderSampler(max_lookahead_versions=0)
    restarted: list[int] = []

    def restore(index: int, handle: Any) -> None:
        restarted.append(index)
        refitter.restore_engine(index, handle)

    m = _manager([engine], sampler, max_in_flight=4, groups_per_call=2, on_engine_restart=restore)
    _run_until(m, lambda: m.groups_in_flight > 0, trainer_step=0)
    engine.crash.remote()
    _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=0, limit_s=400)
    assert restarted == [0] and m.redispatched
    health = ray.get(engine.health.remote())
    assert health.incarnation != first.incarnation and health.weight_version == 4
    assert sorted(m.buffer.ready_ids()) == [0, 1, 2, 3] and sampler.num_ready == 4
    assert all(m.dispatch_counts[g] == 2 for g in m.redispatched)
    assert all(m.dispatch_counts[g] == 1 for g in range(4) if g not in m.redispatched)
    assert {m.buffer.get(g).weight_version for g in range(4)} == {4}
    # the re-dispatched groups are exactly what an undisturbed engine produces
    fresh = ray.get(engine.generate.remote(_requests([0, 1, 2, 3])))
    assert [_strip(o) for o in fresh] == [_strip(m.buffer.get(g).output) for g in range(4)]
    # the refit group is rebuilt around the restarted engine
    assert refitter.refit(version=5).version == 5
    ray.kill(engine)
    ray.kill(holder)


def _wait_for_restart(engine: Any, incarnation: str, *, limit_s: float = 300) -> EngineHealth:
    deadline = time.monotonic() + limit_s
    while True:
        assert time.monotonic() < deadline, "the engine did not come back"
        try:
            health: EngineHealth = ray.get(engine.health.remote(), timeout=60)
        except RayActorError:  # asked while it was dying
            time.sleep(0.2)
            continue
        if health.incarnation != incarnation:
            return health
        time.sleep(0.2)


def test_a_restarted_engine_gets_the_current_weights_before_it_generates() -> None:
    """Issue: a killed engine came back with the weights it was built with and the next
    step trained on its samples. Now it refuses to generate until it is restored, and the
    refitter restores it without a snapshot directory (host copy of the last refit)."""
    (engine,) = launch_embedded_engines(
        1, model=SPEC, run_seed=11, num_cpus=1, name_prefix="phoenix"
    )
    actor: Any = ray.remote(ActorWorker).options(num_cpus=0).remote(ActorConfig(model=SPEC))
    weights = ray.get(actor.export_weights.remote())
    gen = torch.Generator().manual_seed(7)
    ray.get(
        actor.load_weights.remote(
            {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        )
    )
    refitter = WeightRefitter(actor=actor, engines=[engine])  # no snapshot_dir
    refitter.refit(version=3)
    first = ray.get(engine.health.remote(), timeout=300)
    assert first.weight_version == 3 and not first.needs_weights

    os.kill(int(first.extra["pid"]), signal.SIGKILL)  # while idle: no call sees it die
    back = _wait_for_restart(engine, first.incarnation)
    assert back.needs_weights and back.weight_version == 0  # its initial weights, and it says so
    with pytest.raises(EngineRestarted):
        ray.get(engine.generate.remote(_requests([0])))
    bare = _manager([engine], InOrderSampler(max_lookahead_versions=0))
    with pytest.raises(RuntimeError, match="on_engine_restart"):  # no way to restore it: stop
        _run_until(bare, lambda: False, trainer_step=0, limit_s=120)

    sampler = InOrderSampler(max_lookahead_versions=0)
    m = _manager([engine], sampler, on_engine_restart=refitter.restore_engine)
    _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=0, limit_s=300)
    health = ray.get(engine.health.remote())
    assert health.incarnation == back.incarnation
    assert health.weight_version == 3 and not health.needs_weights
    assert {m.buffer.get(g).weight_version for g in range(4)} == {3}
    assert m.redispatched  # the groups it refused were generated after the restore
    outputs = [m.buffer.get(g).output for g in range(4)]
    assert _check_against_trainer(actor, outputs) <= 1  # the trainer's policy
    # the next refit rebuilds the group around the new incarnation
    assert refitter.refit(version=4).version == 4
    assert ray.get(engine.health.remote()).weight_version == 4
    ray.kill(engine)
    ray.kill(actor)


_HANG = threading.Event()


def _stubborn_reward(*, response: str, record: Any, finish_reason: str) -> Any:
    if record["id"] == 1:
        return True  # a bool is not a reward
    if record["id"] == 2:
        _HANG.wait()  # hangs (until the test ends)
    return repeat_reward(response=response, record=record, finish_reason=finish_reason)


def test_a_hung_or_non_numeric_reward_fails_only_its_group(engines: list[Any]) -> None:
    sampler = InOrderSampler(max_lookahead_versions=0)
    m = _manager(engines, sampler, reward_fn=_stubborn_reward, reward_timeout_s=0.5)
    try:
        _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=0)
    finally:
        _HANG.set()
    assert sorted((f.group_id, f.step) for f in m.failures) == [(1, 0), (2, 0)]
    by_id = {f.group_id: f.message for f in m.failures}
    assert (
        "returned True (bool) for prompt 1 sample 0; a reward must return a real number"
        in (by_id[1])
    )
    assert "_stubborn_reward did not return within 0.5 s for prompt 2 sample 0" in by_id[2]
    assert sorted(m.buffer.ready_ids()) == [0, 3, 4, 5]


def _offline_grader(**_: Any) -> float:
    raise ConnectionError("grader offline")


def _fails_for_some(*, response: str, record: Any, finish_reason: str) -> float:
    if record["id"] in (0, 1, 3, 4):
        raise ValueError("no answer")
    return repeat_reward(response=response, record=record, finish_reason=finish_reason)


def test_a_reward_that_always_fails_stops_the_run(engines: list[Any]) -> None:
    # failures with successes in between never add up to a streak
    m = _manager(
        engines,
        InOrderSampler(max_lookahead_versions=0),
        reward_fn=_fails_for_some,
        max_in_flight=1,
        max_consecutive_group_failures=3,
    )
    _run_until(m, lambda: len(m.buffer) == 4 and m.idle(), trainer_step=0)
    assert [f.group_id for f in m.failures] == [0, 1, 3, 4]
    assert sorted(m.buffer.ready_ids()) == [2, 5, 6, 7]

    doomed = _manager(
        engines,
        InOrderSampler(max_lookahead_versions=0),
        reward_fn=_offline_grader,
        max_consecutive_group_failures=5,
    )
    with pytest.raises(RewardFailure) as info:
        _run_until(doomed, lambda: False, trainer_step=0)
    assert len(doomed.failures) == 5 and len(doomed.buffer) == 0
    msg = str(info.value)
    assert "5 prompt groups failed in a row" in msg
    assert "rollout.max_consecutive_group_failures=5" in msg
    # the first failure's traceback, down to the line in the reward that raised
    assert "Traceback (most recent call last)" in msg and "in _offline_grader" in msg
    assert 'raise ConnectionError("grader offline")' in msg
    assert "ConnectionError: grader offline" in msg


def test_the_cluster_and_the_refit_group_listen_on_loopback_only(engines: list[Any]) -> None:
    """Every listening socket of this process tree (Ray's GCS, raylet, agents and
    workers, the actor holding the refit store, the engines' gloo transport) is on
    127.0.0.1 / ::1; the refit adds listeners and they are loopback too."""
    tree = process_tree(os.getpid())
    before = set(listening_sockets(tree))
    actor: Any = ray.remote(ActorWorker).options(num_cpus=0).remote(ActorConfig(model=SPEC))
    refitter = WeightRefitter(actor=actor, engines=engines)
    refitter.refit(version=3)  # the initial weights, as the earlier refit test leaves them
    found = set(listening_sockets(process_tree(os.getpid())))
    assert found - before  # the refit store (in the actor process) and gloo's listeners
    wide = sorted(s for s in found if not is_loopback(s[1]))
    assert wide == [], f"listening beyond loopback (pid, address, port): {wide}"
    ray.kill(actor)


def test_every_group_in_flight_shares_a_round_and_control_calls_never_wait() -> None:
    """The run's engines get a thread per group it may have in flight (all of them can
    be on one engine) plus control threads: 80 groups in flight decode as ONE round (a
    fixed 64 threads made two rounds, twice the decode steps), and control calls are
    answered while they decode instead of queueing behind them."""
    from ppo_driver._engines import CONTROL_THREADS, engine_concurrency
    from ppo_driver.config import load_config

    cfg, _ = load_config(None, ["async_rl.max_prompts_in_flight=80"])
    assert engine_concurrency(cfg) == 80 + CONTROL_THREADS
    (e,) = launch_embedded_engines(
        1, model=SPEC, run_seed=11, num_cpus=1, max_concurrency=engine_concurrency(cfg)
    )
    ray.get(e.health.remote(), timeout=300)
    # 14 decode steps of 0.3 s: a 4 s window for the control call; a 2 s gather window
    # so that a slow submission on a busy machine cannot split the round
    ray.get([e.set_step_delay.remote(0.3), e.set_gather_window.remote(2.0)])
    width = len(DATA.prompt_ids(0))
    same = [i for i in range(len(DATA)) if len(DATA.prompt_ids(i)) == width]
    params = dataclasses.replace(PARAMS, stop_token_ids=())  # every group: 14 steps
    refs = [
        e.generate.remote(
            [GroupRequest(prompt_index=i, prompt_ids=DATA.prompt_ids(i), params=params)]
        )
        for i in (same[k % len(same)] for k in range(80))
    ]
    deadline = time.monotonic() + 120
    while (health := ray.get(e.health.remote(), timeout=120)).extra["busy"] < 80:
        assert time.monotonic() < deadline, f"the round never held all 80 groups: {health}"
        time.sleep(0.05)
    finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    outs = ray.get(refs, timeout=300)
    ray.kill(e)
    assert finished == []  # the control call was answered while all 80 decoded
    assert health.extra["rounds"] == 1 and len(outs) == 80
