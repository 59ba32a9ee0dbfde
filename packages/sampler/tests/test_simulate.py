"""The step simulator: the document's gate examples come out of it, it drives the real
sampler, its degenerate cases are exact, and bad inputs are refused clearly."""

from __future__ import annotations

import dataclasses
import json
import math

import ppo_sampler._samplers
import pytest
from ppo_sampler import (
    GenerationModel,
    LognormalLengths,
    MeasuredLengths,
    TrainingCosts,
    Workload,
    chunk_schedule,
    simulate,
    simulate_minimums,
)
from ppo_sampler.__main__ import main
from ppo_sampler._presets import PRESETS
from ppo_sampler._simulate import SimStep, SimulationResult, default_minimums

FAST = GenerationModel(tokens_per_s=1000.0, concurrency=1000)
"""1 ms per token per sequence; every group of two steps decodes at once."""
COSTS = TrainingCosts(
    value_forward_per_sample=0.01,
    actor_train_per_sample=0.03,
    critic_train_per_sample=0.03,
    critic_epochs=2,
    optimizer_s=0.2,
    refit_s=0.3,
    switch_s=0.1,
    chunk_overhead_s=0.02,
)
# the document's example: 88 groups finish first, then 32, then the last 8
WAVES_88_32_8 = MeasuredLengths(lengths=(10,) * 88 + (20,) * 32 + (30,) * 8, resample=False)


def _chunks(
    workload: Workload, lengths: MeasuredLengths, costs: TrainingCosts = COSTS
) -> set[tuple[int, ...]]:
    result = simulate(workload, FAST, costs, lengths, steps=4, warmup_steps=0)
    return {s.chunk_groups for s in result.steps}


def test_88_plus_40_comes_out_of_the_simulator() -> None:
    wl = Workload(batch=128, min_groups=32, lookahead=0)
    assert _chunks(wl, WAVES_88_32_8) == {(88, 40)}  # not 88 + 32 + 8


def test_every_minimum_chunks_as_the_pure_gate_replays_it() -> None:
    """Groups finishing one at a time and free training: the simulator polls at every
    arrival, so its chunks are chunk_schedule's over 0, 1, ..., 128 ready; the two-thirds
    rule follows: 86..127 run as one chunk, 85 still splits."""
    one_by_one = MeasuredLengths(lengths=tuple(range(1, 129)), resample=False)
    free = TrainingCosts()
    for low in range(1, 129):
        wl = Workload(batch=128, min_groups=low, lookahead=0)
        expected = tuple(chunk_schedule(list(range(129)), batch=128, min_groups=low))
        assert _chunks(wl, one_by_one, free) == {expected}, low
    assert _chunks(Workload(batch=128, min_groups=85, lookahead=0), one_by_one, free) == {(85, 43)}
    for low in (86, 100, 127):
        assert _chunks(Workload(batch=128, min_groups=low, lookahead=0), one_by_one, free) == {
            (128,)
        }


def test_two_thirds_rule_in_the_sweep_table() -> None:
    lengths = LognormalLengths(median=50, sigma=1.0, max_tokens=400)
    table = simulate_minimums(
        Workload(batch=128, min_groups=32, lookahead=0), FAST, COSTS, lengths, steps=4
    )
    by_min = {r.min_groups: r for r in table.rows}
    assert set(default_minimums(128)) == set(by_min)
    assert by_min[85].chunks_per_step > 1 and not by_min[85].single_chunk_only
    assert by_min[96].single_chunk_only and by_min[96].chunks_per_step == 1
    assert by_min[96].step_s == table.full_batch.step_s


def test_a_change_to_the_gate_changes_the_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The samplers call plan_chunk; replacing it changes what the simulator chunks."""
    wl = Workload(batch=128, min_groups=32, lookahead=0)
    before = simulate(wl, FAST, COSTS, WAVES_88_32_8, steps=3).step_s

    def greedy(*, ready: int, remaining: int, min_groups: int, alignment: int = 1) -> int:
        return min(ready, remaining) if ready >= min(min_groups, remaining) else 0

    monkeypatch.setattr(ppo_sampler._samplers, "plan_chunk", greedy)
    assert _chunks(wl, WAVES_88_32_8) == {(88, 32, 8)}  # no tail floor: one switch more
    assert simulate(wl, FAST, COSTS, WAVES_88_32_8, steps=3).step_s != before


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("spg", [1, 4])
def test_groups_finishing_at_once_make_streaming_equal_full_batch(lookahead: int, spg: int) -> None:
    same = MeasuredLengths(lengths=(37,))
    wl = Workload(batch=64, min_groups=8, samples_per_group=spg, lookahead=lookahead)
    table = simulate_minimums(wl, FAST, COSTS, same, minimums=[1, 8, 16, 40, 64], steps=5)
    for row in table.rows:
        assert row.step_s == table.full_batch.step_s
        assert row.chunks_per_step == 1


@pytest.mark.parametrize("batching", ["continuous", "rounds"])
def test_free_training_and_switches_make_step_time_the_generation_time(batching: str) -> None:
    lengths = LognormalLengths(median=40, sigma=0.8, max_tokens=300)
    gen = GenerationModel(tokens_per_s=500.0, concurrency=1000, batching=batching)
    for low in (4, 16, 64):
        result = simulate(
            Workload(batch=64, min_groups=low, lookahead=0), gen, TrainingCosts(), lengths
        )
        for step in result.steps:
            assert step.step_s == step.generation_s
            assert step.busy_s == 0.0
        assert result.idle_frac == 1.0


def test_a_step_of_work_only_is_not_negatively_idle() -> None:
    """A step whose timeline is all work: 0.7 - 0.4 is 0.29999999999999993 in floats and
    the work 0.1 + 0.2 is 0.30000000000000004; idle is 0 (it printed as "-0.0%")."""
    step = SimStep(
        step=0, start_s=0.4, end_s=0.7, chunk_groups=(8,), busy_s=0.1 + 0.2, generation_s=0.1
    )
    result = SimulationResult(
        workload=Workload(batch=8, min_groups=8), steps=(step,), warmup_steps=0
    )
    assert result.idle_frac == 0.0
    assert f"{result.idle_frac:.1%}" == "0.0%"


def test_a_call_hands_its_groups_over_together() -> None:
    """``groups_per_call=16``: the 88 short groups travel in calls of 16, so the sixth
    call (8 short + 8 middle groups) comes back with the middle wave and the eighth
    (8 middle + 8 long) with the long one: 80, 32 and 16 groups arrive, and the chunks
    follow them, instead of the document's 88 + 40 (one group per call)."""
    for per_call, chunks in ((1, {(88, 40)}), (16, {(80, 32, 16)})):
        wl = Workload(batch=128, min_groups=32, lookahead=0, groups_per_call=per_call)
        assert _chunks(wl, WAVES_88_32_8) == chunks, per_call
    with pytest.raises(ValueError, match="groups_per_call"):
        Workload(batch=128, min_groups=32, groups_per_call=0)


# 1 s per token per sequence; block 0 (groups 0-3) holds the one slow group (40 tokens),
# block 1 is done at 10 s with three of block 0, block 2 at 20 s
SLOW_BLOCK_0 = MeasuredLengths(lengths=(10, 10, 10, 40) + (10,) * 4 + (20,) * 4, resample=False)
SECONDS_PER_TOKEN = GenerationModel(tokens_per_s=1000.0, concurrency=1000)


def test_fixed_blocks_wait_for_their_slowest_group_and_merge_when_ready() -> None:
    """By arrival, 7 groups are ready at 10 s and train then (7 s of work at 1 s a
    group), the last 5 at 40 s: 45 s a step. Fixed blocks are filed in dispatch order,
    so block 1, done at 10 s, waits behind block 0 until its slow group ends at 40 s;
    then 12 s of work follow: 52 s. Merging the three ready blocks makes one chunk of
    the same work, which saves the calls of two chunks."""
    costs = TrainingCosts(actor_train_per_sample=1.0)
    expected = {
        (False, False): ((7, 5), 45.0),
        (True, False): ((4, 4, 4), 52.0),
        (True, True): ((12,), 52.0),
        (False, True): ((7, 5), 45.0),  # merging is about fixed blocks only
    }
    for (fixed, merge), (chunks, step_s) in expected.items():
        wl = Workload(
            batch=12,
            min_groups=4,
            lookahead=0,
            deterministic_chunks=fixed,
            merge_ready_blocks=merge,
        )
        result = simulate(wl, SECONDS_PER_TOKEN, costs, SLOW_BLOCK_0, steps=2, warmup_steps=0)
        assert {s.chunk_groups for s in result.steps} == {chunks}, (fixed, merge)
        assert result.step_s == pytest.approx(step_s, rel=1e-12), (fixed, merge)
    with_calls = dataclasses.replace(costs, call_overhead_s=0.5)
    one, three = (
        simulate(
            Workload(
                batch=12, min_groups=4, lookahead=0, deterministic_chunks=True, merge_ready_blocks=m
            ),
            SECONDS_PER_TOKEN,
            with_calls,
            SLOW_BLOCK_0,
            steps=2,
            warmup_steps=0,
        ).step_s
        for m in (True, False)
    )
    saved = 2 * with_calls.chunk_calls(logprob_pass=False) * 0.5
    assert three - one == pytest.approx(saved, rel=1e-12)


def test_blocks_in_length_order_fill_as_groups_finish() -> None:
    """``block_order="length"``: the seven 10-token groups are filed at 10 s (every
    group out has drawn 10 tokens by then), so the first block trains then, as by
    arrival: 44 s. With two decoding slots, groups that wait for a slot hold the order
    back: lengths 10, 2, 3, 4 start at 0, 0, 2 and 5 s (1 token/s); group 1 (2 tokens)
    is filed once group 3 has drawn 2 tokens (7 s) and group 2 once group 3 has drawn
    3 (8 s): block {1, 2} trains at 8 s and {3, 0} after it (3 s a group): 20 s, against
    17 s by arrival ({1, 2} at 5 s) and 22 s in dispatch order (both blocks at 10 s)."""
    costs = TrainingCosts(actor_train_per_sample=1.0)
    wl = Workload(batch=12, min_groups=4, lookahead=0, deterministic_chunks=True)
    length = dataclasses.replace(wl, block_order="length")
    result = simulate(length, SECONDS_PER_TOKEN, costs, SLOW_BLOCK_0, steps=2, warmup_steps=0)
    assert {s.chunk_groups for s in result.steps} == {(4, 4, 4)}
    assert result.step_s == pytest.approx(44.0, rel=1e-12)
    two_slots = GenerationModel(tokens_per_s=2.0, concurrency=2, batching="continuous")
    queued = MeasuredLengths(lengths=(10, 2, 3, 4), resample=False)
    slow = TrainingCosts(actor_train_per_sample=3.0)
    small = Workload(batch=4, min_groups=2, lookahead=0)
    for workload, step_s in (
        (small, 17.0),
        (dataclasses.replace(small, deterministic_chunks=True, merge_ready_blocks=True), 22.0),
        (
            dataclasses.replace(
                small, deterministic_chunks=True, merge_ready_blocks=True, block_order="length"
            ),
            20.0,
        ),
    ):
        got = simulate(workload, two_slots, slow, queued, steps=2, warmup_steps=0)
        assert got.step_s == pytest.approx(step_s, rel=1e-12), workload.chunking


def test_fixed_blocks_need_what_the_sampler_needs() -> None:
    with pytest.raises(ValueError, match="deterministic_chunks"):
        Workload(batch=12, min_groups=4, lookahead=1, deterministic_chunks=True)
    with pytest.raises(ValueError, match="merge_ready_blocks='yes' must be a bool"):
        Workload(batch=12, min_groups=4, merge_ready_blocks="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_order='sideways' is unknown"):
        Workload(batch=12, min_groups=4, block_order="sideways")


def test_longest_group_sets_generation_time() -> None:
    gen = GenerationModel(tokens_per_s=100.0, concurrency=10)  # 0.1 s per token
    lengths = MeasuredLengths(lengths=(5, 50, 7), resample=False)
    result = simulate(Workload(batch=3, min_groups=3, lookahead=0), gen, TrainingCosts(), lengths)
    assert result.steps[0].generation_s == pytest.approx(5.0)


def test_per_group_lengths_are_drawn_once_per_group() -> None:
    gen = GenerationModel(tokens_per_s=100.0, concurrency=100)
    wl = Workload(batch=2, min_groups=2, samples_per_group=4, lookahead=0)
    per_group = MeasuredLengths(lengths=(10, 20), resample=False, per_group=True)
    per_sample = MeasuredLengths(lengths=(10, 20), resample=False)
    free = TrainingCosts()
    # per group: the groups take 10 and 20 tokens; per sample: each group's max is 20
    assert simulate(wl, gen, free, per_group, steps=2).steps[0].generation_s == pytest.approx(20.0)
    assert simulate(wl, gen, free, per_sample, steps=2).steps[0].generation_s == pytest.approx(20.0)
    assert [s.generation_s for s in simulate(wl, gen, free, per_group, steps=3).steps] == [
        pytest.approx(20.0)
    ] * 3


def test_rounds_wait_for_the_running_round() -> None:
    """Two groups in flight at most, lookahead 1, 0.1 s per token. Group 0 (10 tokens)
    ends at 1 s and group 2 (30 tokens, step 1) is sent then: continuously batched it
    ends at 4 s; in rounds it waits for the round of group 1 (30 tokens, until 3 s) and
    ends at 6 s. Group 3 (10 tokens) is sent at 3 s: it ends at 4 s either way."""
    lengths = MeasuredLengths(lengths=(10, 30, 30, 10), resample=False)
    wl = Workload(batch=2, min_groups=1, lookahead=1, max_in_flight=2)
    ends = {}
    for batching in ("continuous", "rounds"):
        gen = GenerationModel(tokens_per_s=1000.0, concurrency=100, batching=batching)
        result = simulate(wl, gen, TrainingCosts(), lengths, steps=2, warmup_steps=0)
        ends[batching] = result.steps[1].generation_s  # step 1's groups: sent at 1 s
    assert ends == {"continuous": pytest.approx(3.0), "rounds": pytest.approx(5.0)}


def test_streaming_hides_chunk_work_behind_a_long_tail() -> None:
    lengths = LognormalLengths(median=200, sigma=0.9, max_tokens=4000)
    gen = GenerationModel(tokens_per_s=5000.0, concurrency=256, engines=2)
    table = simulate_minimums(
        Workload(batch=128, min_groups=32, samples_per_group=4, lookahead=0),
        gen,
        COSTS,
        lengths,
        steps=5,
    )
    best = next(r for r in table.rows if r.min_groups == table.recommended_min_groups)
    assert table.recommended_min_groups < 128
    assert best.speedup > 1.0
    assert best.overlap_efficiency is not None and 0 < best.overlap_efficiency <= 1.5
    assert 0 < best.idle_frac < table.full_batch.idle_frac
    assert "SIMULATION" in table.format() and "<- recommended" in table.format()


def test_same_seed_same_result_other_seed_other_lengths() -> None:
    lengths = LognormalLengths(median=50, sigma=1.0, max_tokens=500)
    wl = Workload(batch=32, min_groups=8)
    a = simulate(wl, FAST, COSTS, lengths, seed=3)
    assert a == simulate(wl, FAST, COSTS, lengths, seed=3)
    assert a.steps != simulate(wl, FAST, COSTS, lengths, seed=4).steps


@pytest.mark.parametrize("logprob_pass", [False, True])
def test_policy_epochs_full_batch_runs_the_logprob_pass_when_asked(logprob_pass: bool) -> None:
    """Full batch with K > 1 epochs: by default its epoch 1 gives the old log-probs, as a
    streamed step's does (the driver's pump); ``logprob_pass``: a separate forward first."""
    same = MeasuredLengths(lengths=(10,))
    costs = TrainingCosts(
        actor_train_per_sample=1.0,
        actor_forward_per_sample=0.5,
        policy_epochs=3,
        logprob_pass=logprob_pass,
    )
    stream = simulate(Workload(batch=4, min_groups=2, lookahead=0), FAST, costs, same)
    full = simulate(Workload(batch=4, min_groups=4, lookahead=0), FAST, costs, same)
    # streaming: 3 epochs of 4 samples; full batch: the log-prob forward too, if asked
    assert full.step_s - stream.step_s == pytest.approx(0.5 * 4 if logprob_pass else 0.0)


# -- per-call overhead and the actor's repeat passes ---------------------------------------
CALL = 0.05
"""Seconds of the driver per model call (no other cost below)."""


@pytest.mark.parametrize("lookahead", [0, 1])
def test_groups_finishing_at_once_stay_equal_with_call_overhead(lookahead: int) -> None:
    """One policy epoch: streaming's single chunk makes the same calls as a full batch."""
    same = MeasuredLengths(lengths=(37,))
    costs = dataclasses.replace(COSTS, call_overhead_s=CALL)
    wl = Workload(batch=64, min_groups=8, samples_per_group=4, lookahead=lookahead)
    table = simulate_minimums(wl, FAST, costs, same, minimums=[1, 8, 64], steps=5)
    assert table.full_batch.step_s > simulate(wl, FAST, COSTS, same, steps=5).step_s
    for row in table.rows:
        assert row.step_s == table.full_batch.step_s


@pytest.mark.parametrize(
    ("epochs", "full_calls", "stream_calls"),
    [
        pytest.param(1, 5, 5, id="one-epoch"),  # value, train_chunk, finish_step, refit, critic
        pytest.param(2, 7, 6, id="two-epochs"),  # streaming: + train_epochs; full: + log-prob
        pytest.param(4, 7, 6, id="four-epochs"),  # the same calls whatever K > 1
    ],
)
def test_call_overhead_is_paid_per_call_of_the_mode(
    epochs: int, full_calls: int, stream_calls: int
) -> None:
    """A full batch with K > 1 epochs and ``logprob_pass`` calls the actor four times
    after the chunks (the log-prob forward, epoch 1's ``train_chunk``, ``finish_step``,
    ``train_epochs``), streaming twice: the mode's overhead follows its calls (all groups
    finish at once, so both make one chunk and nothing else differs)."""
    same = MeasuredLengths(lengths=(10,))
    costs = TrainingCosts(call_overhead_s=CALL, policy_epochs=epochs, logprob_pass=True)
    assert costs.calls_per_step(1, logprob_pass=epochs > 1) == full_calls
    assert costs.calls_per_step(1, logprob_pass=False) == stream_calls
    slow = GenerationModel(tokens_per_s=1.0, concurrency=1000)  # 1 s per token: 10 s a step
    kw = {"steps": 4, "warmup_steps": 1}
    stream = simulate(Workload(batch=4, min_groups=2, lookahead=0), slow, costs, same, **kw)
    full = simulate(Workload(batch=4, min_groups=4, lookahead=0), slow, costs, same, **kw)
    assert stream.chunks_per_step == full.chunks_per_step == 1
    assert full.step_s - stream.step_s == pytest.approx(CALL * (full_calls - stream_calls))
    for result, calls in ((stream, stream_calls), (full, full_calls)):
        assert result.measured[0].busy_s == pytest.approx(CALL * calls)


def test_repeat_epochs_cost_the_same_in_both_modes() -> None:
    """Epoch 1 is the actor's first pass over the samples, epochs 2..K repeat it, in both
    modes: with equal lengths a full batch differs from streaming by its log-prob pass."""
    same = MeasuredLengths(lengths=(10,))
    costs = TrainingCosts(
        actor_train_per_sample=1.0,
        actor_epoch_per_sample=0.25,
        actor_forward_per_sample=0.5,
        policy_epochs=3,
        logprob_pass=True,
    )
    assert costs.after_chunks_s(4, logprob_pass=True) == pytest.approx(0.5 * 4 + 4 + 2 * 0.25 * 4)
    assert costs.after_chunks_s(4, logprob_pass=False) == pytest.approx(2 * 0.25 * 4)
    stream = simulate(Workload(batch=4, min_groups=2, lookahead=0), FAST, costs, same)
    full = simulate(Workload(batch=4, min_groups=4, lookahead=0), FAST, costs, same)
    assert full.step_s - stream.step_s == pytest.approx(0.5 * 4)


def test_cli_takes_the_call_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--batch", "16", "--min-groups", "16", "--lengths", "5", "--json"]
    argv += ["--tokens-per-s", "100", "--concurrency", "100", "--steps", "3"]
    assert main(argv) == 0
    base = json.loads(capsys.readouterr().out)["full_batch_step_s"]
    assert main([*argv, "--call-overhead-s", "0.5"]) == 0
    with_calls = json.loads(capsys.readouterr().out)["full_batch_step_s"]
    assert with_calls > base + 0.5  # several calls a step


def test_cli_takes_the_logprob_pass(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--batch", "16", "--min-groups", "16", "--lengths", "5", "--json"]
    argv += ["--tokens-per-s", "100", "--concurrency", "100", "--steps", "3"]
    argv += ["--policy-epochs", "2", "--actor-forward", "0.1"]
    assert main(argv) == 0
    base = json.loads(capsys.readouterr().out)["full_batch_step_s"]
    assert main([*argv, "--logprob-pass"]) == 0
    with_pass = json.loads(capsys.readouterr().out)["full_batch_step_s"]
    assert main([*argv, "--no-logprob-pass"]) == 0
    assert json.loads(capsys.readouterr().out)["full_batch_step_s"] == base  # the default
    assert with_pass > base + 1.0  # the batch's forward (the preset's packed samples)


# -- costs that follow the lengths (scaling) ---------------------------------------------
def test_work_of_a_pass_in_each_scaling() -> None:
    groups = [[2, 6], [4, 4]]  # two groups of two samples: responses of 2..6 tokens
    assert TrainingCosts().work(groups) == 4.0
    padded = TrainingCosts(scaling="padded", reference_tokens=8.0, prompt_tokens=2.0)
    assert padded.work(groups) == 4 * (2 + 6) / 8  # every row padded to the widest
    packed = dataclasses.replace(padded, scaling="packed")
    assert packed.work(groups) == (4 + 8 + 6 + 6) / 8  # each row's own tokens


@pytest.mark.parametrize("scaling", ["padded", "packed"])
def test_equal_lengths_at_the_reference_cost_what_samples_do(scaling: str) -> None:
    """Every response 37 tokens, the prompt 3: a sample is exactly the reference one,
    so the timeline is the per-sample model's, to the bit, for every minimum."""
    same = MeasuredLengths(lengths=(37,))
    wl = Workload(batch=32, min_groups=4, samples_per_group=2, lookahead=0)
    scaled = dataclasses.replace(
        COSTS, scaling=scaling, reference_tokens=40.0, prompt_tokens=3.0, policy_epochs=3
    )
    plain = dataclasses.replace(COSTS, policy_epochs=3)
    for low in (4, 32):
        a = simulate(wl.with_min_groups(low), FAST, plain, same, steps=3)
        b = simulate(wl.with_min_groups(low), FAST, scaled, same, steps=3)
        assert [s.end_s for s in a.steps] == [s.end_s for s in b.steps]


def test_padded_full_batch_pays_the_widest_row_and_chunks_their_own() -> None:
    """Three short groups (10 tokens) and one long (40): the streamed chunks (the
    three short ones, then the long one) are padded to their own longest response, the
    full batch to 40 for every row."""
    lengths = MeasuredLengths(lengths=(10, 10, 10, 40), resample=False, per_group=True)
    costs = TrainingCosts(
        actor_train_per_sample=1.0, scaling="padded", reference_tokens=10.0, prompt_tokens=0.0
    )
    wl = Workload(batch=4, min_groups=1, lookahead=0)
    stream = simulate(wl, FAST, costs, lengths, steps=1, warmup_steps=0).steps[0]
    full = simulate(wl.with_min_groups(4), FAST, costs, lengths, steps=1, warmup_steps=0).steps[0]
    assert stream.chunk_groups == (3, 1)
    assert stream.chunk_work == (3.0, 4.0)
    assert full.chunk_work == (16.0,)
    assert full.busy_s == 16.0 and stream.busy_s == 7.0  # work in seconds: 1 s per sample
    per_sample = dataclasses.replace(costs, scaling="sample")
    flat = simulate(wl, FAST, per_sample, lengths, steps=1, warmup_steps=0).steps[0]
    assert flat.busy_s == 4.0  # what scaling="sample" would have said


def test_packed_tail_chunk_costs_more_than_its_share() -> None:
    """Long-tail lengths, costs per token: the last chunk, which holds the groups that
    finished last (the longest), costs more per sample than the earlier ones."""
    lengths = LognormalLengths(median=100, sigma=0.8, max_tokens=2000)
    costs = dataclasses.replace(COSTS, scaling="packed", reference_tokens=100.0)
    wl = Workload(batch=64, min_groups=16, samples_per_group=4, lookahead=0)
    for step in simulate(wl, FAST, costs, lengths, steps=4, warmup_steps=0).steps:
        per_sample = [w / (g * 4) for w, g in zip(step.chunk_work, step.chunk_groups, strict=True)]
        assert len(per_sample) > 1 and per_sample[-1] > max(per_sample[:-1])


def test_cli_takes_the_scaling(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--batch", "8", "--min-groups", "8", "--lengths", "10,40", "--json"]
    argv += ["--tokens-per-s", "100", "--concurrency", "100", "--steps", "3"]
    assert main([*argv, "--scaling", "sample"]) == 0
    flat = json.loads(capsys.readouterr().out)["full_batch_step_s"]
    assert main([*argv, "--scaling", "padded", "--reference-tokens", "25"]) == 0
    padded = json.loads(capsys.readouterr().out)["full_batch_step_s"]
    assert padded > flat  # rows of 10 and 40 tokens padded to 40 (+512 prompt tokens)


BAD = [
    pytest.param(
        lambda: TrainingCosts(scaling="tokens"), "scaling='tokens' is unknown", id="scaling"
    ),
    pytest.param(
        lambda: TrainingCosts(scaling="padded"), "needs reference_tokens", id="no-reference"
    ),
    pytest.param(
        lambda: TrainingCosts(scaling="packed", reference_tokens=0.0),
        "reference_tokens=0.0",
        id="zero-reference",
    ),
    pytest.param(lambda: TrainingCosts(prompt_tokens=-1.0), "prompt_tokens=-1.0", id="neg-prompt"),
    pytest.param(
        lambda: TrainingCosts(call_overhead_s=-0.5), "call_overhead_s=-0.5", id="neg-call"
    ),
    pytest.param(lambda: TrainingCosts(switch_s=-1.0), "switch_s=-1.0", id="negative-switch"),
    pytest.param(
        lambda: TrainingCosts(actor_train_per_sample=-0.1), "actor_train_per_sample", id="neg-cost"
    ),
    pytest.param(lambda: TrainingCosts(refit_s=math.inf), "refit_s=inf", id="infinite-cost"),
    pytest.param(lambda: TrainingCosts(critic_epochs=0), "critic_epochs=0", id="no-critic-epoch"),
    pytest.param(lambda: MeasuredLengths(lengths=()), "lengths=()", id="empty-lengths"),
    pytest.param(lambda: MeasuredLengths(lengths=(3, -1)), r"lengths\[1\]=-1", id="neg-length"),
    pytest.param(
        lambda: LognormalLengths(median=0, sigma=1, max_tokens=10), "median=0", id="zero-median"
    ),
    pytest.param(
        lambda: Workload(batch=128, min_groups=129),
        "min_groups_for_streaming_train=129 exceeds ppo.num_prompts_per_step=128",
        id="minimum-above-batch",
    ),
    pytest.param(
        lambda: Workload(batch=128, min_groups=0), "min_groups_for_streaming_train=0", id="zero-min"
    ),
    pytest.param(
        lambda: Workload(batch=10, min_groups=4, alignment=4),
        "batch=10 is not a multiple",
        id="align",
    ),
    pytest.param(lambda: Workload(batch=8, min_groups=4, sampler="fifo"), "'fifo'", id="sampler"),
    pytest.param(
        lambda: GenerationModel(tokens_per_s=0, concurrency=1), "tokens_per_s=0", id="no-speed"
    ),
    pytest.param(
        lambda: GenerationModel(tokens_per_s=1, concurrency=1, batching="x"),
        "batching='x'",
        id="batching",
    ),
    pytest.param(
        lambda: simulate(Workload(batch=4, min_groups=2), FAST, COSTS, WAVES_88_32_8, steps=0),
        "steps=0",
        id="no-steps",
    ),
    pytest.param(
        lambda: simulate_minimums(
            Workload(batch=4, min_groups=2), FAST, COSTS, WAVES_88_32_8, minimums=[2, 5]
        ),
        "min_groups_for_streaming_train=5",
        id="swept-minimum-above-batch",
    ),
]


@pytest.mark.parametrize(("build", "match"), BAD)
def test_bad_inputs_are_refused_naming_the_value(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()  # type: ignore[operator]


# -- python -m ppo_sampler simulate ------------------------------------------------------
def test_cli_prints_the_table_of_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "7b-8gpu", "--min-groups", "32,256", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATION" in out and "projection" in out
    assert "   32 " in out and "  256 " in out


def test_cli_options_override_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--batch", "16", "--min-groups", "4", "--lengths", "5,5,50", "--json"]
    assert main([*argv, "--tokens-per-s", "100", "--concurrency", "100", "--steps", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"][0]["min_groups"] == 4
    assert data["workload"]["batch"] == 16
    assert data["full_batch_step_s"] > 0
    assert main([*argv, "--groups-per-call", "4", "--steps", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["groups_per_call"] == 4


def test_cli_bad_input_exits_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--batch", "16", "--min-groups", "17"])
    assert exc.value.code == 2
    assert "min_groups_for_streaming_train=17 exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--batch", "16", "--min-groups", "4", "--groups-per-call", "0"])
    assert exc.value.code == 2
    assert "groups_per_call" in capsys.readouterr().err


def test_cli_without_subcommand_still_prints_the_schedule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 0
    assert "chunks: 88 + 40 = 128" in capsys.readouterr().out


def test_presets_are_labelled_and_stream_faster() -> None:
    for name, preset in PRESETS.items():
        assert "simulation" in preset.description.lower(), name
        table = simulate_minimums(
            preset.workload, preset.generation, preset.costs, preset.lengths, steps=3
        )
        assert table.recommended_min_groups < preset.workload.batch, name


def test_length_order_files_a_group_only_once_every_group_out_drew_more() -> None:
    """``block_order="length"`` files a group once every group of its step still out
    has drawn MORE tokens than it (an equal count is not more). One engine, one sequence
    at a time, two groups a call: the call {0, 1} (10 and 20 tokens) returns at 30 s,
    {2, 3} (10 and 30) at 70 s. Group 2 never draws more than group 0's 10 tokens, so
    group 0 is filed only when group 2 comes back, at 70 s: the four 1-s blocks then
    train one after the other and the step ends at 74 s."""
    wl = Workload(
        batch=4,
        min_groups=1,
        lookahead=0,
        deterministic_chunks=True,
        block_order="length",
        groups_per_call=2,
    )
    gen = GenerationModel(tokens_per_s=1.0, concurrency=1, engines=1)
    lengths = MeasuredLengths(lengths=(10, 20, 10, 30), resample=False, per_group=True)
    costs = TrainingCosts(actor_train_per_sample=1.0)
    result = simulate(wl, gen, costs, lengths, steps=1, warmup_steps=0)
    assert result.steps[0].end_s == pytest.approx(74.0, rel=1e-12)


def test_length_order_counts_groups_not_yet_dispatched_as_drawing_nothing() -> None:
    """With fewer groups in flight than the batch, a group not yet dispatched has drawn
    nothing, so no group is filed before every group of the step is out: the first block
    is the step's two shortest groups (10 + 20 tokens), the second the two longest
    (30 + 40), whatever order they were dispatched and finished in."""
    wl = Workload(
        batch=4,
        min_groups=2,
        lookahead=0,
        deterministic_chunks=True,
        block_order="length",
        max_in_flight=2,
    )
    gen = GenerationModel(tokens_per_s=1.0, concurrency=1, engines=4)
    lengths = MeasuredLengths(lengths=(30, 40, 10, 20), resample=False, per_group=True)
    costs = TrainingCosts(scaling="packed", reference_tokens=1.0)
    result = simulate(wl, gen, costs, lengths, steps=1, warmup_steps=0)
    assert result.steps[0].chunk_work == (30.0, 70.0)
