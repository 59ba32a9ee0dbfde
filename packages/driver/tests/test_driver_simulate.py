"""``ppo-driver simulate --from``: fitted on a real run directory, it reproduces that run's
step time and answers what-if options; bad input is refused naming it.

``data/sim_run`` is the ``config.yaml``, ``metrics.jsonl`` and ``trace.json`` that
``ppo-driver train --run-dir data/sim_run run.num_steps=4 run.checkpoint_every=0``
wrote (the built-in task: 64 prompts x 4 samples, minimum 16), copied unchanged.
``data/sim_run_full``: the same files of a full-batch run of ``bench/bench_sim.py``'s
``balanced`` profile (larger models, 4 policy epochs), 5 steps, recorded before
ppo-driver 0.8.1 (a log-prob pass, then each epoch a ``train_chunk`` + ``finish_step``
pair); ``data/sim_run_full_kept``: the same profile and steps recorded by ppo-driver
0.8.1 (streaming's calls with one chunk: epoch 1's ``train_chunk``, whose forward gives
the old log-probs, keeps the batch, ``finish_step``, then one ``train_epochs`` for
epochs 2..4). ``data/sim_run_gb``: steps 40-45 of a default run of
``bench/bench_learning.py --profile generation-bound`` (0.1 s per decode step; it
cut its chunks as groups arrived, which its ``config.yaml`` now says explicitly:
``deterministic_chunks: false``), the trace's events of those steps only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from driver_testlib import TINY_RUN
from ppo_driver.cli import main
from ppo_driver.simulate import _widths, fit_run, simulate_run
from ppo_driver.trace import TraceEvent
from ppo_sampler import simulate

RUN = Path(__file__).resolve().parent / "data" / "sim_run"
FULL_RUN = RUN.parent / "sim_run_full"
KEPT_RUN = RUN.parent / "sim_run_full_kept"
FULL_RUNS = pytest.mark.parametrize("run", [FULL_RUN, KEPT_RUN], ids=["pairs", "kept"])
GB_RUN = RUN.parent / "sim_run_gb"


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_fit_reproduces_the_measured_step_time() -> None:
    fit = fit_run(RUN)
    assert fit.steps_used == 3  # the first step (start-up) is left out
    assert fit.workload.batch == 64 and fit.workload.min_groups == 16
    assert fit.workload.samples_per_group == 4 and fit.costs.policy_epochs == 4
    assert len(fit.lengths.lengths) == 3 * 64 and fit.lengths.per_group
    predicted = simulate(fit.workload, fit.generation, fit.costs, fit.lengths).step_s
    assert abs(predicted - fit.measured_step_s) / fit.measured_step_s < 0.05
    # every timed phase is in the model: none of it is left as unexplained overhead
    assert fit.costs.step_overhead_s < 0.2 * fit.measured_step_s


@pytest.mark.parametrize(
    ("rollout", "per_call"),
    [
        pytest.param({}, 1, id="recorded-before-the-key"),
        pytest.param({"groups_per_call": None}, 16, id="null-embedded"),
        pytest.param({"groups_per_call": None, "decode_delay_s": 0.1}, 1, id="null-delay"),
        pytest.param({"groups_per_call": 8}, 8, id="given"),
    ],
)
def test_fit_sends_groups_as_the_run_did(
    tmp_path: Path, rollout: dict[str, Any], per_call: int
) -> None:
    """The simulated calls carry the groups per call the run used: its
    ``rollout.groups_per_call`` resolved as train resolves it, and one per call for a
    run recorded before the key existed (it sent one group per call)."""
    for name in ("metrics.jsonl", "trace.json"):
        shutil.copy(RUN / name, tmp_path)
    config = yaml.safe_load((RUN / "config.yaml").read_text())
    assert "groups_per_call" not in config["rollout"]  # data/sim_run predates the key
    config["rollout"].update(rollout)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert fit_run(tmp_path).workload.groups_per_call == per_call


@FULL_RUNS
def test_fit_of_a_full_batch_run_reproduces_it(run: Path) -> None:
    """Full batch with K epochs: all of its step is modelled, none is left as per-step
    overhead, whichever pump recorded the run. The projection is of today's pump: a run
    recorded with the separate log-prob pass is projected without it (with
    ``logprob_pass`` on, as it ran)."""
    fit = fit_run(run)
    assert fit.workload.min_groups == fit.workload.batch == 64
    assert fit.costs.policy_epochs == 4 and not fit.costs.logprob_pass
    rows = _rows(run)[1:]
    logprob_s = sum(float(r.get("perf/logprob_s", 0.0)) for r in rows) / len(rows)
    assert (logprob_s > 0) == (run == FULL_RUN)
    as_ran = replace(fit.costs, logprob_pass=logprob_s > 0)
    predicted = simulate(fit.workload, fit.generation, as_ran, fit.lengths).step_s
    assert abs(predicted - fit.measured_step_s) / fit.measured_step_s < 0.05
    today = simulate(fit.workload, fit.generation, fit.costs, fit.lengths).step_s
    assert abs(today - (fit.measured_step_s - logprob_s)) / fit.measured_step_s < 0.05
    assert fit.costs.step_overhead_s < 0.1 * fit.measured_step_s


def test_cli_prints_the_fit_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--from", str(RUN), "--min-groups", "8,16,64"]) == 0
    out = capsys.readouterr().out
    assert "fitted on 3 step(s): measured 1.303 s/step" in out
    assert main(["simulate", "--from", str(RUN), "--skip-steps", "3"]) == 0
    assert "fitted on 1 step(s): measured 1.222 s/step" in capsys.readouterr().out
    assert "SIMULATION (a projection" in out
    rows = [
        line.split() for line in out.splitlines() if line.strip().split(" ")[0] in ("8", "16", "64")
    ]
    assert [r[0] for r in rows] == ["8", "16", "64"]


def test_what_if_options_change_the_projection(capsys: pytest.CaptureFixture[str]) -> None:
    fit = fit_run(RUN)
    base = simulate_run(fit, minimums=[16])
    assert simulate_run(fit, minimums=[16], batch=32).full_batch.workload.batch == 32
    assert simulate_run(fit, minimums=[16], batch=32).rows[0].step_s < base.rows[0].step_s
    assert simulate_run(fit, minimums=[16], engines=1) == base  # the run had one engine
    assert simulate_run(fit, minimums=[16], lookahead=1).full_batch.workload.lookahead == 1
    assert main(["simulate", "--from", str(RUN), "--no-streaming", "--engines", "2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("  min ") :].splitlines()[1:]
    assert len(table) == 1 and table[0].split()[0] == "64"


def _copy_run(run: Path, to: Path, **async_rl: object) -> Path:
    """``run``'s files in ``to``, with these ``async_rl`` keys in its config."""
    shutil.copytree(run, to)
    config = yaml.safe_load((to / "config.yaml").read_text())
    config["async_rl"].update(async_rl)
    (to / "config.yaml").write_text(yaml.safe_dump(config))
    return to


def test_chunks_are_cut_as_the_run_cut_them(tmp_path: Path) -> None:
    """The generation-bound run cut its chunks as groups arrived (written ``false``:
    ``null`` meant that there before ppo-driver 0.8.1). Fixed blocks in dispatch order
    wait for each block's slowest group: every chunk is whole blocks of 16 and the step
    is longer; a run that wrote ``true`` is simulated so. Today's ``null`` there is
    fixed blocks in length order (filed as they finish): whole blocks too, and about
    as early as by arrival. A null under a look-ahead cuts by arrival again."""
    fit = fit_run(GB_RUN)
    assert fit.deterministic_given is False and not fit.workload.deterministic_chunks
    arrival = simulate_run(fit, minimums=[16])
    fixed = simulate_run(fit, minimums=[16], deterministic_chunks=True)
    assert fixed.full_batch.workload.deterministic_chunks
    assert fixed.full_batch.workload.block_order == "dispatch"  # the run had no block_order
    assert fixed.full_batch.step_s == arrival.full_batch.step_s  # one chunk either way
    assert any(n % 16 for n in arrival.rows[0].chunk_groups)  # by arrival: any size
    assert all(n % 16 == 0 for n in fixed.rows[0].chunk_groups)
    assert fixed.rows[0].step_s > arrival.rows[0].step_s
    written = fit_run(_copy_run(GB_RUN, tmp_path / "fixed", deterministic_chunks=True))
    assert simulate_run(written, minimums=[16]) == fixed
    apart = fit_run(_copy_run(GB_RUN, tmp_path / "apart", merge_ready_blocks=False))
    one_per_block = simulate_run(apart, minimums=[16], deterministic_chunks=True)
    assert set(one_per_block.rows[0].chunk_groups) == {16}
    now = fit_run(_copy_run(GB_RUN, tmp_path / "now", deterministic_chunks=None, block_order=None))
    assert now.workload.deterministic_chunks and now.workload.block_order == "length"
    by_length = simulate_run(now, minimums=[16])
    assert all(n % 16 == 0 for n in by_length.rows[0].chunk_groups)
    assert by_length.rows[0].step_s < fixed.rows[0].step_s
    assert not simulate_run(
        now, minimums=[16], lookahead=1
    ).full_batch.workload.deterministic_chunks
    null = fit_run(_copy_run(RUN, tmp_path / "null", deterministic_chunks=None))
    assert null.workload.deterministic_chunks  # no decode delay: generation on shared cores
    assert null.workload.block_order == "dispatch"


def test_cli_takes_the_chunking(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--from", str(GB_RUN), "--min-groups", "16"]
    assert main([*argv, "--deterministic-chunks", "true"]) == 0
    assert "chunks: fixed blocks in dispatch order, every ready one in one chunk" in (
        capsys.readouterr().out
    )
    assert main(argv) == 0
    assert "chunks: as groups arrive" in capsys.readouterr().out
    assert main([*argv, "--deterministic-chunks", "true", "--lookahead", "1"]) == 2
    err = capsys.readouterr().err
    assert "async_rl.deterministic_chunks=true needs" in err and "max_lookahead_versions=0" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--min-groups", "99"], "min_groups_for_streaming_train=99 exceeds", id="min"),
        pytest.param(
            ["--no-streaming", "--min-groups", "8"], "--no-streaming contradict", id="mix"
        ),
        pytest.param(["--engines", "0"], "engines=0", id="engines"),
        pytest.param(["--batch", "0"], "num_prompts_per_step=0", id="batch"),
        pytest.param(["--skip-steps", "-1"], "--skip-steps=-1", id="skip"),
    ],
)
def test_bad_options_exit_2_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--from", str(RUN), *argv]) == 2
    assert message in capsys.readouterr().err


def test_not_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--from", str(tmp_path)]) == 2
    assert "config.yaml is missing" in capsys.readouterr().err
    shutil.copy(RUN / "config.yaml", tmp_path)
    lines = (RUN / "metrics.jsonl").read_text().splitlines()
    old = [{k: v for k, v in json.loads(x).items() if k != "rollout/group_len_max"} for x in lines]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert main(["simulate", "--from", str(tmp_path)]) == 2
    assert "no rollout/group_len_max for step(s) [0, 1, 2, 3]" in capsys.readouterr().err


@pytest.mark.slow
def test_end_to_end_from_a_fresh_run(tmp_path: Path) -> None:
    """A real run through the CLI, then ``ppo-driver simulate`` on its directory."""
    run = tmp_path / "run"
    train = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run)]
    overrides = [*TINY_RUN, "run.num_steps=3", "run.checkpoint_every=0", "--no-progress"]
    done = subprocess.run([*train, *overrides], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(run)
    assert all(len(r["rollout/group_len_max"]) == 8 for r in rows)  # type: ignore[arg-type]
    sim = [
        sys.executable,
        "-m",
        "ppo_driver.cli",
        "simulate",
        "--from",
        str(run),
        "--min-groups",
        "2,8",
    ]
    out = subprocess.run(sim, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "fitted on 2 step(s)" in out.stdout and "SIMULATION" in out.stdout


def test_generation_speed_comes_from_windows_the_pump_saw_end() -> None:
    """A window that ends as a wait of its step ends was observed as it ended; one that
    ends while the pump trained (no wait there) is only an upper bound."""
    from ppo_driver.simulate import _observed_ends

    def event(cat: str, step: int, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"step": step}}

    events = [
        event("generation", 1, 0.0, 2e6),
        event("wait", 1, 1.5e6, 0.5e6 + 10_000),  # ends 10 ms after the window: observed
        event("generation", 2, 3e6, 2e6),
        event("wait", 2, 3e6, 0.5e6),  # ends 1.5 s before the window: not observed
        event("generation", 3, 6e6, 1e6),  # no wait at all
    ]
    assert _observed_ends(events) == {1}


def test_full_batch_fit_takes_epoch_1_and_the_repeats_from_the_trace() -> None:
    """A full batch's first ``train_chunk`` of a step (epoch 1) and the later ones
    (epochs 2..K) are fitted apart, as streaming's chunks and ``train_epochs`` are: the
    means of the trace's calls, per sample."""
    fit = fit_run(FULL_RUN)
    steps = {
        json.loads(x)["step"] for x in (FULL_RUN / "metrics.jsonl").read_text().splitlines()[1:]
    }
    calls: dict[int, list[tuple[float, float]]] = {}
    for e in json.loads((FULL_RUN / "trace.json").read_text())["traceEvents"]:
        if e.get("name") == "train_chunk" and e["args"].get("step") in steps:
            calls.setdefault(e["args"]["step"], []).append((e["ts"], e["dur"] / 1e6))
    assert {len(c) for c in calls.values()} == {fit.costs.policy_epochs}
    firsts = [min(c)[1] for c in calls.values()]
    repeats = [d for c in calls.values() for _, d in sorted(c)[1:]]
    samples = fit.workload.batch * fit.workload.samples_per_group
    assert fit.costs.actor_train_per_sample == pytest.approx(sum(firsts) / len(firsts) / samples)
    assert fit.costs.actor_epoch_per_sample == pytest.approx(sum(repeats) / len(repeats) / samples)


def test_kept_full_batch_fit_takes_each_epoch_from_its_call() -> None:
    """A full batch recorded by ppo-driver 0.8.1 makes streaming's calls: epoch 1 is
    its one ``train_chunk`` (``perf/backward_s``), ``finish_step`` its optimizer step and
    ``train_epochs`` epochs 2..K with theirs (together ``perf/update_s``); no log-prob
    pass. (Fitted as K pairs, epoch 1 came out K times too cheap.)"""
    fit = fit_run(KEPT_RUN)
    rows = _rows(KEPT_RUN)[1:]
    steps = {r["step"] for r in rows}
    calls: dict[str, float] = {}
    for e in json.loads((KEPT_RUN / "trace.json").read_text())["traceEvents"]:
        if e.get("cat") == "update" and e["args"].get("step") in steps:
            calls[e["name"]] = calls.get(e["name"], 0.0) + e["dur"] / 1e6 / len(steps)
    samples = fit.workload.batch * fit.workload.samples_per_group
    epochs = fit.costs.policy_epochs

    def per_sample(key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows) / samples

    assert fit.costs.actor_train_per_sample == pytest.approx(per_sample("perf/backward_s"))
    assert all("perf/logprob_s" not in r for r in rows)
    assert fit.costs.optimizer_s == pytest.approx(calls["finish_step"])
    later = (calls["train_epochs"] / (epochs - 1) - calls["finish_step"]) / samples
    assert fit.costs.actor_epoch_per_sample == pytest.approx(later)
    # epochs 2..K repeat epoch 1's pass over the same rows: within a factor of 2 of it
    assert 0.5 < later / fit.costs.actor_train_per_sample < 2.0


def test_actor_passes_need_two_calls_in_a_step_and_order_by_time() -> None:
    from ppo_driver.simulate import _actor_passes

    def call(step: int, ts: float, dur: float) -> TraceEvent:
        return TraceEvent(
            name="train_chunk", cat="backward", ph="X", ts=ts, dur=dur, pid=1, tid=1,
            args={"step": step},
        )  # fmt: skip

    assert _actor_passes([call(1, 0.0, 1e6), call(2, 5e6, 1e6)], {1, 2}) is None  # streaming
    later_first = [call(1, 3e6, 1e6), call(1, 0.0, 3e6), call(1, 5e6, 2e6), call(9, 0.0, 9e6)]
    assert _actor_passes(later_first, {1}) == (3.0, 1.5)  # step 9 is not fitted on


@pytest.mark.parametrize(
    ("run", "made"),
    [(RUN, 6), (FULL_RUN, 12), (KEPT_RUN, 6)],
    ids=["streaming", "full-batch-pairs", "full-batch-kept"],
)
def test_untimed_time_is_charged_per_model_call(run: Path, made: int) -> None:
    """What the workers did not time (the driver's round trips and work between calls) is
    fitted per call the run made (counted in its trace: a full batch with K = 4 epochs
    made 12 a step before ppo-driver 0.8.1, 6 since, as streaming in one chunk), so a
    prediction pays for the calls the mode makes today."""
    fit = fit_run(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()[1:]
    rows: list[dict[str, float]] = [
        {k: v for k, v in json.loads(x).items() if isinstance(v, int | float)} for x in lines
    ]
    phases = ("wait", "value", "backward", "logprob", "update", "refit", "critic", "switch")

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / len(rows)

    untimed = mean("perf/step_s") - sum(mean(f"perf/{p}_s") for p in phases)
    assert mean("train/chunks") == 1.0
    assert fit.costs.call_overhead_s * made == pytest.approx(untimed)
    assert fit.costs.step_overhead_s == fit.costs.chunk_overhead_s == 0.0
    assert fit.costs.calls_per_step(1, logprob_pass=False) == 6  # both modes, K > 1


def _with_widths(tmp_path: Path, run: Path, widths: Callable[[dict[str, Any]], list[int]]) -> Path:
    """A copy of ``run`` whose metrics rows record ``widths(row)`` as the chunks' padded
    widths (the fitted data recorded none: ppo-driver 0.8.1 did not write them)."""
    out = tmp_path / run.name
    shutil.copytree(run, out)
    rows = _rows(run)
    for r in rows:
        r["train/chunk_widths"] = widths(r)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_a_run_without_widths_is_fitted_per_sample() -> None:
    assert fit_run(RUN).costs.scaling == "sample"


def test_widths_scale_the_costs_per_padded_token(tmp_path: Path) -> None:
    """Every chunk padded to the step's width (a 4-token prompt + the step's longest
    response): the costs are the per-sample fit's, per sample of the mean width, and
    the fit still reproduces the run's step time with the costs scaled per chunk."""

    def prompt_plus(r: dict[str, Any]) -> list[int]:
        return [4 + max(r["rollout/group_len_max"])] * len(r["train/chunk_groups"])

    flat = fit_run(_with_widths(tmp_path / "a", RUN, prompt_plus))
    plain = fit_run(RUN)
    assert flat.costs.scaling == "padded" and flat.costs.prompt_tokens == 4
    widest = [4 + max(r["rollout/group_len_max"]) for r in _rows(RUN)[1:]]
    assert flat.costs.reference_tokens == pytest.approx(sum(widest) / len(widest))
    assert flat.costs.critic_train_per_sample == pytest.approx(plain.costs.critic_train_per_sample)
    assert flat.costs.actor_train_per_sample == pytest.approx(plain.costs.actor_train_per_sample)

    predicted = simulate(flat.workload, flat.generation, flat.costs, flat.lengths).step_s
    assert abs(predicted - flat.measured_step_s) / flat.measured_step_s < 0.05


def test_widths_weigh_chunks_by_their_groups_and_critic_by_the_step() -> None:
    """Chunks of 16 and 48 groups padded to 10 and 16 tokens, longest response 12: a
    sample's mean padded width is (16 * 10 + 48 * 16) / 64 = 14.5, the prompt 16 - 12,
    and the step batch (critic training) is 16 / 14.5 times wider."""
    row = {"train/chunk_widths": [10, 16], "train/chunk_groups": [16, 48]}
    rows = [{**row, "rollout/group_len_max": [12, 3, 7]}, {**row, "rollout/group_len_max": [11]}]
    w = _widths(rows)  # type: ignore[arg-type]
    assert w is not None
    assert (w.reference, w.prompt, w.step_ratio) == (14.5, 4.5, 16 / 14.5)
    assert _widths([{"train/chunk_groups": [64]}]) is None  # type: ignore[list-item]
