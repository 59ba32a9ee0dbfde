"""The pump's pure parts: chunk selection with the real sampler, batch assembly, and the
residency plan it executes (no Ray, no models)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from ppo_driver.pump import (
    ChunkGate,
    NonFiniteError,
    _Residency,
    _sum_dicts,
    assemble_full_batch,
    check_finite_metrics,
)
from ppo_driver.trace import TraceRecorder
from ppo_lifecycle import ALL_PARTS, KEEP_GRADIENTS, Phase, Role
from ppo_sampler import InOrderSampler, ReadyFirstSampler


def _run_step(gate: ChunkGate, arrivals: list[list[int]], *, step: int = 0) -> list[list[int]]:
    """Feed ``arrivals`` (bursts of finished group ids) and claim chunks after each burst,
    as the pump does between polls. Returns the claimed chunks."""
    gate.begin_step(step)
    chunks: list[list[int]] = []
    for burst in arrivals:
        for gid in burst:
            gate.sampler.add(gid, step=step, weight_version=step)
        while ids := gate.take(trainer_version=step):
            chunks.append(ids)
    assert gate.remaining == 0
    return chunks


def _one_by_one(batch: int, seed: int) -> list[list[int]]:
    order = list(range(batch))
    random.Random(seed).shuffle(order)
    return [[g] for g in order]


@pytest.mark.parametrize(
    "sampler_cls", [InOrderSampler, ReadyFirstSampler], ids=["in_order", "ready_first"]
)
@pytest.mark.parametrize("minimum", range(11, 17))
def test_batch16_minimum_11_to_16_always_one_chunk(sampler_cls: Any, minimum: int) -> None:
    """The document: a minimum above about two thirds of the batch cannot leave the tail
    floor, so every step is one chunk, whatever the arrival pattern."""
    for seed in range(5):
        gate = ChunkGate(sampler_cls(), batch=16, min_groups=minimum, alignment=1)
        chunks = _run_step(gate, _one_by_one(16, seed))
        assert [len(c) for c in chunks] == [16]


@pytest.mark.parametrize("minimum", [1, 2, 4, 8, 10])
def test_streaming_minimum_splits_one_by_one_arrivals(minimum: int) -> None:
    gate = ChunkGate(InOrderSampler(), batch=16, min_groups=minimum, alignment=1)
    chunks = _run_step(gate, _one_by_one(16, 0))
    sizes = [len(c) for c in chunks]
    assert len(sizes) > 1
    assert all(s >= minimum for s in sizes[:-1])
    # nothing duplicated or dropped
    flat = [g for c in chunks for g in c]
    assert sorted(flat) == list(range(16))


def test_document_example_88_plus_40() -> None:
    gate = ChunkGate(InOrderSampler(), batch=128, min_groups=32, alignment=1)
    chunks = _run_step(gate, [list(range(88)), list(range(88, 120)), list(range(120, 128))])
    assert [len(c) for c in chunks] == [88, 40]


def test_steps_never_share_or_lose_groups() -> None:
    gate = ChunkGate(InOrderSampler(max_lookahead_versions=1), batch=8, min_groups=2, alignment=2)
    seen: list[int] = []
    for step in range(3):
        ids = [step * 8 + i for i in range(8)]
        chunks = _run_step(gate, [ids[:3], ids[3:5], ids[5:]], step=step)
        assert all(len(c) % 2 == 0 for c in chunks)
        step_ids = gate.finish_step()
        gate.sampler.mark_consumed(step_ids)
        assert sorted(step_ids) == ids
        seen += step_ids
    assert sorted(seen) == list(range(24))


def _chunk(pids: list[int], width: int) -> dict[str, torch.Tensor]:
    b = len(pids)
    return {
        "input_ids": torch.arange(b * width).reshape(b, width) + 3,
        "loss_mask": torch.ones(b, width),
        "prompt_indices": torch.tensor(pids),
    }


def test_assemble_full_batch_pads_and_orders_by_prompt() -> None:
    full = assemble_full_batch([_chunk([5, 1], 3), _chunk([0, 2, 4], 5)], pad_id=0)
    assert full["prompt_indices"].tolist() == [0, 1, 2, 4, 5]
    assert full["input_ids"].shape == (5, 5)
    # rows of the narrow chunk are right padded with pad_id and mask 0
    row1 = full["input_ids"][1]
    assert row1[3:].tolist() == [0, 0]
    assert full["loss_mask"][1, 3:].tolist() == [0.0, 0.0]


class _Recorder:
    """Stands in for a TrainGroup: records the lifecycle calls the plan issues."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def call(self, method: str, **kwargs: Any) -> list[None]:
        parts = kwargs.get("parts")
        tag = "" if parts is None else ("(keep_grads)" if parts == KEEP_GRADIENTS else "(all)")
        assert parts in (None, KEEP_GRADIENTS, ALL_PARTS)
        self.log.append(f"{self.name}.{method}{tag}")
        return [None]


def test_residency_keeps_actor_grads_between_chunks_and_never_switches_redundantly() -> None:
    log: list[str] = []
    res = _Residency(_Recorder("actor", log), _Recorder("critic", log), TraceRecorder())
    res.start()
    log.clear()
    for _chunk_index in range(2):
        res.prepare(Phase.VALUE_FORWARD, step=0)
        res.prepare(Phase.POLICY_FORWARD, step=0)
        res.prepare(Phase.POLICY_BACKWARD, step=0)
        res.prepare(Phase.WAIT, Phase.VALUE_FORWARD, step=0)  # prepare the critic before waiting
        res.prepare(Phase.WAIT, Phase.VALUE_FORWARD, step=0)  # an empty selection: nothing moves
    res.prepare(Phase.VALUE_FORWARD, step=0)
    res.prepare(Phase.POLICY_UPDATE, step=0)
    res.prepare(Phase.REFIT, step=0)
    res.prepare(Phase.CRITIC_TRAIN, step=0)
    assert log == [
        "critic.sleep(all)", "actor.wake_up",
        "actor.sleep(keep_grads)", "critic.wake_up",
        "critic.sleep(all)", "actor.wake_up",
        "actor.sleep(keep_grads)", "critic.wake_up",
        "critic.sleep(all)", "actor.wake_up",
        "actor.sleep(all)", "critic.wake_up",
    ]  # fmt: skip
    saved: list[str] = []
    res.save_both(saved.append, step=0)
    assert saved == ["critic", "actor"]
    assert res.resident == "critic"


def test_fused_chunk_plan_moves_each_switch_into_the_neighbouring_model_call() -> None:
    """The pump fuses a chunk's switches into its model calls: the critic leaves in the
    call that computes values, the actor arrives in the call that computes log-probs,
    and leaves (keeping gradients) in its backward call; nothing is planned twice."""
    log: list[str] = []
    res = _Residency(_Recorder("actor", log), _Recorder("critic", log), TraceRecorder())
    res.start()
    log.clear()
    assert res.plan(Phase.VALUE_FORWARD) == []  # the critic is already resident
    to_actor = res.plan(Phase.POLICY_FORWARD)
    split = res.split(to_actor, after=Role.CRITIC)
    assert split is not None
    lead, follow = split
    assert [f"{t}" for t in lead] == ["critic.sleep(all)"]
    assert [f"{t}" for t in follow] == ["actor.wake_up"]
    ops = res.as_ops([*lead, *follow])
    assert [(op.method, op.kwargs, op.phase) for op in ops] == [
        ("sleep", {"parts": ALL_PARTS}, "switch"),
        ("wake_up", {}, "switch"),
    ]
    assert res.plan(Phase.POLICY_BACKWARD) == []
    to_critic = res.plan(Phase.WAIT, Phase.VALUE_FORWARD)
    split = res.split(to_critic, after=Role.ACTOR)
    assert split is not None
    assert [f"{t}" for t in split[0]] == ["actor.sleep(keep_grads)"]
    assert res.as_ops(split[0])[0].kwargs == {"parts": KEEP_GRADIENTS}
    assert [f"{t}" for t in split[1]] == ["critic.wake_up"]
    # planned = taken as done: an empty selection moves nothing, no call was made here
    assert res.plan(Phase.WAIT, Phase.VALUE_FORWARD) == []
    assert res.resident == Role.CRITIC and res.switches == 2
    assert log == []
    # a plan whose shape cannot be fused (the first role again after the other) is refused
    assert res.split([*follow, *lead], after=Role.CRITIC) is None


class _EchoWorker:
    def __init__(self, config: Any, *, rank: int, world_size: int, dist_init_method: Any) -> None:
        self.rank = rank

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def add(self, a: torch.Tensor, *, b: torch.Tensor) -> torch.Tensor:
        return a + b


def test_fused_call_runs_ops_in_order_and_recalls_earlier_results() -> None:
    """``_Host.run``: one round trip for several worker calls; ``Recall`` hands an op
    what an earlier call on the same rank returned, without the driver."""
    from ppo_driver.workers import Recall, _Host

    threads = torch.get_num_threads()
    try:
        host = _Host(_EchoWorker, None, 0, 1, None)
    finally:
        torch.set_num_threads(threads)
    x = torch.arange(3.0)
    out = host.run([("double", (x,), {}), ("add", (x,), {"b": Recall("double")})])
    assert [r.tolist() for r, _, _ in out] == [[0.0, 2.0, 4.0], [0.0, 3.0, 6.0]]
    assert all(t0 <= t1 for _, t0, t1 in out)
    # a later call still recalls the latest result
    (again,) = host.run([("add", (Recall("add"),), {"b": x})])
    assert again[0].tolist() == [0.0, 4.0, 8.0]
    with pytest.raises(ValueError, match="no result of missing"):
        host.run([("add", (x,), {"b": Recall("missing")})])


def test_metric_reducer_keeps_non_finite_values_and_the_step_refuses_them() -> None:
    """Issue 11: the reducer used to drop a non-finite value, so ``loss/value`` silently
    vanished from metrics.jsonl; now it is kept and the step is refused, naming it."""
    summed = _sum_dicts([{"loss/value": 1.0, "n": 1.0}, {"loss/value": float("inf"), "n": 2.0}])
    assert summed == {"loss/value": float("inf"), "n": 3.0}
    check_finite_metrics(4, {"step": 4, "loss/pg": 0.5, "train/chunk_groups": [2, 2]})
    with pytest.raises(NonFiniteError, match=r"^step 4: non-finite metric\(s\): ") as info:
        check_finite_metrics(4, {"step": 4, **summed, "critic/grad_norm": float("nan")})
    assert "critic/grad_norm = nan, loss/value = inf" in str(info.value)
    assert info.value.step == 4
