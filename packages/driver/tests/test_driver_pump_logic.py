"""The pump's pure parts: chunk selection with the real sampler, typed batch assembly,
row splitting over the mesh (no Ray, no models). The residency plan is
ppo_lifecycle's ``ResidencyPlanner`` (tested there)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from driver_testlib import chunk_batch
from ppo_driver.batch import ChunkBatch, StepBatch
from ppo_driver.pump import ChunkGate, NonFiniteError, check_finite_metrics
from ppo_driver.workers import (
    NOW,
    CallOptions,
    GroupResult,
    Pending,
    Rows,
    TrainGroup,
    WorkerLost,
    _Host,
    block_shards,
    data_parallel_layout,
    mini_batch_order,
    shard_rows,
)
from ppo_lifecycle import Part
from ppo_sampler import InOrderSampler, ReadyFirstSampler
from ppo_trainer import ActorConfig, ActorWorker, CriticWorker, Mesh


def _run_step(
    gate: ChunkGate,
    arrivals: list[list[int]],
    *,
    step: int = 0,
    blocks: list[list[int]] | None = None,
) -> list[list[int]]:
    """Feed ``arrivals`` (bursts of finished group ids) and claim chunks after each burst,
    as the pump does between polls. Returns the claimed chunks (``blocks``: each one's
    ``gate.blocks`` is appended)."""
    gate.begin_step(step)
    chunks: list[list[int]] = []
    for burst in arrivals:
        for gid in burst:
            gate.sampler.add(gid, step=step, weight_version=step)
        while ids := gate.take(trainer_version=step):
            chunks.append(ids)
            if blocks is not None:
                blocks.append(list(gate.blocks))
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


@pytest.mark.parametrize("merge", [False, True])
def test_fixed_blocks_that_are_ready_go_into_one_chunk(merge: bool) -> None:
    """Deterministic chunks (blocks of 4 groups out of 16, the last taking 4): with
    ``merge_blocks`` every block whose groups are all done is claimed in ONE chunk, in
    block order; the cuts stay at the blocks' edges (a block is never split), so each
    chunk is whole blocks whatever arrived."""
    sampler = InOrderSampler(max_lookahead_versions=0, fixed_chunks=True)
    gate = ChunkGate(sampler, batch=16, min_groups=4, alignment=1, merge_blocks=merge)
    # groups 0-10 done (blocks 0 and 1 whole, block 2 not), then 11, then the rest
    sizes: list[list[int]] = []  # the gate's groups per block of each chunk
    chunks = _run_step(gate, [list(range(11)), [11], list(range(12, 16))], blocks=sizes)
    blocks = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    if merge:
        assert chunks == [blocks[0] + blocks[1], blocks[2], blocks[3]]
        assert sizes == [[4, 4], [4], [4]]
    else:
        assert chunks == blocks
        assert sizes == [[4]] * 4


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


def test_step_batch_pads_and_orders_by_prompt() -> None:
    full = StepBatch.assemble(
        [chunk_batch([5, 1], 3), chunk_batch([0, 2, 4], 5)], pad_id=7, group_sizes=[2, 3]
    )
    assert full.prompt_indices.tolist() == [0, 1, 2, 4, 5]
    assert full.input_ids.shape == (5, 5)
    assert full.chunk_sizes == (2, 3)
    # rows of the narrow chunk are right padded with pad_id and mask 0
    assert full.input_ids[1, 3:].tolist() == [7, 7]
    assert full.loss_mask[1, 3:].tolist() == [0.0, 0.0]
    assert full.attention_mask[1, 3:].tolist() == [0, 0]


def test_step_batch_keeps_each_prompts_samples_in_arrival_order() -> None:
    """Rows are sorted by prompt index only: a prompt's samples keep their order (a
    stable sort; an unstable one reorders rows of equal keys in a batch this size)."""
    rng = random.Random(0)
    pids = [p for p in range(64) for _ in range(4)]
    rng.shuffle(pids)
    chunks = [chunk_batch(pids[i : i + 32], 2) for i in range(0, 256, 32)]
    full = StepBatch.assemble(chunks, pad_id=0, group_sizes=[8] * 8)
    arrival = torch.cat([c.input_ids[:, 0] for c in chunks])  # distinct per row
    for p in range(64):
        rows = full.input_ids[full.prompt_indices == p, 0].tolist()
        assert rows == [int(t) for t, q in zip(arrival, pids, strict=True) if q == p]


def test_chunk_batch_names_the_stage_of_a_field_not_filled_yet() -> None:
    rows = chunk_batch([0], 2).model_inputs()
    assert sorted(rows) == ["attention_mask", "input_ids", "loss_mask"]
    bare = dataclasses.replace(chunk_batch([0], 2), advantages=None)
    with pytest.raises(ValueError, match="advantages is not filled yet"):
        bare.need("advantages")
    with pytest.raises(ValueError, match=r"missing \['rewards'"):
        ChunkBatch.from_rollout({k: v for k, v in rows.items()})
    with pytest.raises(ValueError, match="advantages is not filled yet"):
        StepBatch.assemble([bare], pad_id=0, group_sizes=[1])


@pytest.mark.parametrize(
    ("rows", "dp", "per_rank"), [(16, 1, 4), (16, 2, 4), (16, 2, 3), (24, 4, 2), (8, 2, 8)]
)
def test_critic_mini_batches_are_the_same_global_ones_for_any_data_parallel_size(
    rows: int, dp: int, per_rank: int
) -> None:
    """Rank ``r``'s ``k``-th local mini-batch (what ``CriticWorker.train`` walks, in steps
    of ``per_rank`` over its shard) is its slice of global mini-batch ``k``: the rows
    ``[k G, (k+1) G)`` with ``G = per_rank * dp``, the last one shorter; together the
    ranks train on exactly the mini-batches one rank of size ``G`` would."""
    order = mini_batch_order(rows, dp, per_rank).tolist()
    assert sorted(order) == list(range(rows))  # a permutation
    shards = [order[s] for s in shard_rows(rows, dp)]
    block = per_rank * dp
    global_batches = [set(range(a, min(a + block, rows))) for a in range(0, rows, block)]
    local = [
        [set(shard[a : a + per_rank]) for a in range(0, len(shard), per_rank)] for shard in shards
    ]
    assert all(len(batches) == len(global_batches) for batches in local)
    for k, expected in enumerate(global_batches):
        assert set().union(*(batches[k] for batches in local)) == expected, k
    if dp == 1:
        assert order == list(range(rows))
    with pytest.raises(ValueError, match="do not split over 3 data-parallel ranks"):
        mini_batch_order(8, 3, 2)


def test_rows_split_over_data_parallel_ranks_only() -> None:
    """Tensor/pipeline peers of one data-parallel rank get the same rows; results come
    from one rank per data-parallel group, in data-parallel order."""
    assert [(s.start, s.stop) for s in shard_rows(8, 2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="do not split over 3 data-parallel ranks"):
        shard_rows(8, 3)

    def mesh(rank: int, *, dp_rank: int, tp: int = 1, pp: int = 1) -> Mesh:
        return Mesh(
            rank=rank, world_size=4, dp_rank=dp_rank, dp_size=4 // (tp * pp), tp_size=tp,
            pp_size=pp, tp_rank=rank % tp, pp_rank=rank // (4 // pp),
        )  # fmt: skip

    # 4 ranks, TP=2 (megatron's order: tensor ranks adjacent): dp rank 0 = ranks 0, 1
    dp_of, leaders = data_parallel_layout([mesh(r, dp_rank=r // 2, tp=2) for r in range(4)])
    assert dp_of == [0, 0, 1, 1] and leaders == [0, 2]
    # PP=2 with DP=2 (pipeline stages outermost): dp rank = rank % 2
    dp_of, leaders = data_parallel_layout([mesh(r, dp_rank=r % 2, pp=2) for r in range(4)])
    assert dp_of == [0, 1, 0, 1] and leaders == [0, 1]
    with pytest.raises(ValueError, match="different data-parallel sizes"):
        data_parallel_layout([mesh(0, dp_rank=0, tp=2), mesh(1, dp_rank=0, tp=4)])
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of 2 have no member"):
        data_parallel_layout([mesh(r, dp_rank=0, tp=2) for r in range(4)])
    got = GroupResult(values=[torch.tensor([1.0]), torch.tensor([2.0])])
    assert got.tensor().tolist() == [1.0, 2.0]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_chunk_of_blocks_gives_every_rank_its_share_of_each_block(dp: int) -> None:
    """Three fixed blocks (8, 8 and 16 rows) in one chunk: rank ``r`` gets, in block
    order, exactly the rows it would get were each block a chunk of its own (its
    contiguous share of the block), and per-sample results come back in the chunk's
    row order."""
    blocks = [8, 8, 16]
    rows = Rows({"input_ids": torch.arange(32).unsqueeze(1)}, blocks=blocks)
    starts = [0, 8, 16]
    expected = [
        [
            start + i
            for start, size in zip(starts, blocks, strict=True)
            for i in range(size)[shard_rows(size, dp)[r]]
        ]
        for r in range(dp)
    ]
    split = [rows.tensors["input_ids"][s].squeeze(1).tolist() for s in rows.split(dp)]
    assert split == expected
    assert [t.tolist() for t in block_shards(blocks, dp)] == expected
    # each rank's result is its rows' ids: back in the chunk's order, whatever dp
    result = GroupResult(
        values=[torch.tensor(ids, dtype=torch.float) for ids in expected], order=rows.order(dp)
    )
    assert result.tensor().tolist() == [float(i) for i in range(32)]
    if dp == 1:  # one rank: the chunk's own order, nothing to put back
        assert rows.order(dp) is None
    # one block: the contiguous shares, as before
    assert Rows({"x": torch.zeros(8, 1)}, blocks=[8]).order(2) is None
    with pytest.raises(ValueError, match=r"blocks \[8, 8\] do not add up to the 32 rows"):
        Rows({"input_ids": torch.zeros(32, 1)}, blocks=[8, 8])


class _EchoWorker:
    def __init__(self, config: Any, *, rank: int, world_size: int, dist_init_method: Any) -> None:
        self.rank = rank

    def mesh(self) -> Mesh:
        return Mesh(
            rank=0, world_size=1, dp_rank=0, dp_size=1, tp_size=1, pp_size=1, tp_rank=0, pp_rank=0
        )

    def double(self, rows: dict[str, torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
        return rows["x"] * 2 * scale


def _build(host: _Host) -> Mesh:
    """``host.build(None)`` (its mesh), with this process's torch thread count
    restored afterwards (a build sets it for the rank)."""
    threads = torch.get_num_threads()
    try:
        return host.build(None)
    finally:
        torch.set_num_threads(threads)


def test_host_builds_on_request_and_calls_with_rows_and_per_sample_tensors() -> None:
    """``_Host``: the process starts empty, ``build`` makes the worker (the driver
    builds one model at a time), ``call`` passes the rows positionally and times it."""
    host = _Host(_EchoWorker, ActorConfig(), 0, 1)
    assert host.worker is None
    assert _build(host).dp_size == 1
    out, timeline = host.call("double", {"x": torch.arange(3.0)}, {"scale": torch.ones(3)}, {})
    assert out.tolist() == [0.0, 2.0, 4.0]
    ((label, t0, t1),) = timeline
    assert label == "double" and t0 <= t1


def test_metric_reducer_keeps_non_finite_values_and_the_step_refuses_them() -> None:
    """Issue 11: the reducer used to drop a non-finite value, so ``loss/value`` silently
    vanished from metrics.jsonl; now it is kept and the step is refused, naming it."""
    summed = GroupResult(
        values=[{"loss/value": 1.0, "n": 1.0}, {"loss/value": float("inf"), "n": 2.0}]
    ).summed()
    assert summed == {"loss/value": float("inf"), "n": 3.0}
    # numbers every rank computed alike are data-parallel rank 0's
    assert GroupResult(values=[{"n": 1.0}, {"n": 2.0}]).reduced() == {"n": 1.0}
    check_finite_metrics(4, {"step": 4, "loss/pg": 0.5, "train/chunk_groups": [2, 2]})
    with pytest.raises(NonFiniteError, match=r"^step 4: non-finite metric\(s\): ") as info:
        check_finite_metrics(4, {"step": 4, **summed, "critic/grad_norm": float("nan")})
    assert "critic/grad_norm = nan, loss/value = inf" in str(info.value)
    assert info.value.step == 4


def test_host_passes_positional_arguments_after_the_rows() -> None:
    """A typed call's positional arguments (e.g. ``save_checkpoint(path)``) reach the
    worker method after the rows, the per-sample tensors as keywords."""

    class _Worker(_EchoWorker):
        def shift(self, rows: dict[str, torch.Tensor], by: float, *, scale: torch.Tensor) -> Any:
            return rows["x"] * scale + by

    host = _Host(_Worker, ActorConfig(), 0, 1)
    _build(host)
    rows, scale = {"x": torch.arange(3.0)}, {"scale": torch.full((3,), 2.0)}
    out, _ = host.call("shift", rows, scale, {}, args=(10.0,))
    assert out.tolist() == [10.0, 12.0, 14.0]


def _unstarted_group(worker_cls: Any) -> TrainGroup[Any]:
    """A group with no ranks (no Ray): what the checks before any Ray call see."""
    group: TrainGroup[Any] = object.__new__(TrainGroup)
    group.role, group.worker_cls, group.handles = "actor", worker_cls, []
    group.meshes, group.leaders, group._dp_of = (
        [
            Mesh(
                rank=0,
                world_size=1,
                dp_rank=0,
                dp_size=1,
                tp_size=1,
                pp_size=1,
                tp_rank=0,
                pp_rank=0,
            )
        ],
        [0],
        [0],
    )
    return group


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda g: g.submit(NOW, CriticWorker.compute_values),
            "CriticWorker.compute_values is not a method of ActorWorker",
            id="another-workers-method",
        ),
        pytest.param(
            lambda g: g.submit(NOW, ActorWorker.finish_step, wake_first=True),
            "finish_step: pass wake_first / sleep_after as CallOptions",
            id="lifecycle-as-a-keyword",
        ),
        pytest.param(
            lambda g: g.submit(
                NOW, ActorWorker.train_chunk, advantages=torch.zeros(2), loss_denominator=1.0
            ),
            r"train_chunk: per-sample tensors \['advantages'\] without rows",
            id="per-sample-without-rows",
        ),
    ],
)
def test_a_group_call_the_type_checker_would_refuse_is_refused_before_ray(
    call: Callable[[TrainGroup[Any]], object], message: str
) -> None:
    """The typed calls are checked by mypy; the same mistakes made past it (an untyped
    caller, ``Any``) are refused at the call, naming the method, before Ray sees them."""
    with pytest.raises(TypeError, match=message):
        call(_unstarted_group(ActorWorker))


def test_a_call_failing_for_another_groups_dead_rank_is_not_blamed_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A critic call queued after an actor call (``CallOptions.after``) fails with the
    dead actor's error; the critic's group must not name its own rank (the run's fault
    handler names the rank that died), while its own rank's death is named at once."""
    import ray

    died = ray.exceptions.ActorDiedError()

    def get(refs: Any) -> Any:
        raise died

    monkeypatch.setattr(ray, "get", get)
    lost = WorkerLost("critic", 0, 961, "127.0.0.1", "ActorDiedError")
    for owned in (False, True):
        pending: Pending[object] = Pending([], [0], lambda _: lost, lambda _, o=owned: o)
        with pytest.raises((WorkerLost, ray.exceptions.ActorDiedError)) as info:
            pending.result()
        assert info.value is (lost if owned else died)


def test_a_lost_worker_is_named_by_the_death_not_by_rays_task_wrapper() -> None:
    """A call running (or queued behind another group's call) when the process died
    raises Ray's ``RayTaskError(ActorDiedError)`` class; the message names the death."""
    import ray.exceptions as rex
    from ppo_driver.workers import error_name

    wrapped = rex.RayTaskError("train_chunk", "tb", rex.ActorDiedError()).as_instanceof_cause()
    assert type(wrapped).__name__ == "RayTaskError(ActorDiedError)"
    assert error_name(wrapped) == error_name(rex.ActorDiedError()) == "ActorDiedError"
    assert error_name(ValueError()) == "ValueError"


def test_host_keeps_the_timeline_its_call_recorded_not_an_earlier_calls() -> None:
    """``_Host.call`` returns the worker's ``last_timeline`` when this call recorded it
    (it starts at or after the call did), and the call's own span in place of one an
    earlier call left behind."""

    class _Timed(_EchoWorker):
        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            self.timeline: list[tuple[str, float, float]] = []

        def last_timeline(self) -> list[tuple[str, float, float]]:
            return self.timeline

        def timed(self, rows: dict[str, torch.Tensor]) -> None:
            self.timeline = [("timed.work", time.time(), time.time())]

    host = _Host(_Timed, ActorConfig(), 0, 1)
    _build(host)
    start = time.time()
    _, timeline = host.call("timed", {"x": torch.zeros(1)}, {}, {})
    ((label, t0, _),) = timeline
    assert label == "timed.work" and t0 >= start
    stale = [("wake_up", start - 10.0, start - 9.0)]  # left by an earlier call
    assert isinstance(host.worker, _Timed)
    host.worker.timeline = stale
    _, timeline = host.call("double", {"x": torch.zeros(1)}, {"scale": torch.ones(1)}, {})
    ((label, t0, t1),) = timeline
    assert label == "double" and start <= t0 <= t1


class _Remote:
    """A rank's ``call`` method as a Ray actor handle has it: ``.remote`` records."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def remote(self, *args: Any, **kwargs: Any) -> tuple[str, int]:
        self.got.append((args, kwargs))
        return ("ref", self.rank)


def test_a_row_call_gives_every_rank_its_rows_and_orders_it_after_the_queued_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``TrainGroup.submit_rows`` on four ranks, tensor parallel 2 (data-parallel ranks 0,
    0, 1, 1), a chunk of two fixed blocks of 4 rows: every rank gets ONE call carrying its
    data-parallel rank's rows (its share of each block) and the same rows of every
    per-sample tensor, the plain arguments with the plan's lifecycle choice, and the refs
    of the calls it must follow. The result is taken from the first rank of each
    data-parallel group, its rows put back in the chunk's order."""
    import ray

    monkeypatch.setattr(ray, "put", lambda value: value)  # the object store: the value
    group = _unstarted_group(ActorWorker)
    remotes = [_Remote(rank) for rank in range(4)]
    group.handles = [type("Handle", (), {"call": r})() for r in remotes]
    group.meshes = [
        Mesh(
            rank=r,
            world_size=4,
            dp_rank=r // 2,
            dp_size=2,
            tp_size=2,
            pp_size=1,
            tp_rank=r % 2,
            pp_rank=0,
        )
        for r in range(4)
    ]
    group._dp_of, group.leaders = data_parallel_layout(group.meshes)
    rows = Rows({"input_ids": torch.arange(8)[:, None]}, blocks=[4, 4])
    lost = WorkerLost("actor", 0, None, None, "ActorDiedError")
    queued: Pending[object] = Pending(["sleep0", "wake1"], [0], lambda _: lost, lambda _: False)
    options = CallOptions(wake_first=True, sleep_after=frozenset({Part.GRADIENTS}), after=[queued])
    pending = group.submit_rows(
        options,
        ActorWorker.train_chunk,
        rows,
        advantages=torch.arange(8.0) * 10,
        loss_denominator=16.0,
        keep=True,
    )
    shares = [[0, 1, 4, 5], [2, 3, 6, 7]]  # each data-parallel rank's half of each block
    for rank, remote in enumerate(remotes):
        ((args, kwargs),) = remote.got
        name, own_rows, per_sample, plain, *after = args
        assert name == "train_chunk" and kwargs == {"args": ()}
        assert own_rows["input_ids"].squeeze(1).tolist() == shares[rank // 2], rank
        assert per_sample["advantages"].tolist() == [10.0 * i for i in shares[rank // 2]]
        assert plain == {
            "loss_denominator": 16.0,
            "keep": True,
            "wake_first": True,
            "sleep_after": frozenset({Part.GRADIENTS}),
        }
        assert after == ["sleep0", "wake1"]
    # each rank answers its rows' ids; the tensor-parallel peers (ranks 1 and 3) answer
    # something else, which must not be read
    answers = [torch.tensor(shares[r // 2], dtype=torch.float) * (-1) ** r for r in range(4)]
    monkeypatch.setattr(ray, "get", lambda refs: [(answers[r], [("w", r, r)]) for _, r in refs])
    result = pending.result()
    assert result.tensor().tolist() == [float(i) for i in range(8)]
    assert result.timeline == [("w", 0, 0)]
