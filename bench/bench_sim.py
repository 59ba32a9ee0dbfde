"""Calibration of the step simulator: fitted on one run, how well does it predict another?

For each ``bench_driver`` profile, three settings run in one Ray cluster, interleaved
(the order rotates from profile to profile so that drifting machine load does not always
hit the same setting): the profile's streaming minimum, another minimum (half the
batch), and the full batch. Then each run is fitted (``ppo_driver.simulate.fit_run``:
its config, metrics and trace) and the simulator predicts the mean step time of the two
OTHER settings. Reported per profile and pair: measured and predicted seconds per step,
the error ``|predicted - measured| / measured``, and whether the fit predicts which of
streaming and full batch is faster. The first step of every run (start-up) is neither
fitted nor measured; the ``separate`` profile resumes from a checkpoint of 6 full-batch
learning steps, as in ``bench_driver``. A speed probe (one fixed single-thread workload)
runs before each run and after the last; its spread around a profile's runs is printed
with that profile's errors: on a shared host identical work varies by that much.

    uv run --frozen python bench/bench_sim.py [--profiles separate,tiny] [--steps 5]
        [--keep DIR]            # keep the run directories there
    uv run --frozen python bench/bench_sim.py --refit DIR   # fit and predict again, no runs
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_driver  # (the profiles and the run helper, next to this file)


def _settings(overrides: list[str]) -> list[tuple[str, int | None]]:
    """(name, minimum) per setting; None: the full batch."""
    from ppo_driver.config import load_config

    cfg, _ = load_config(None, overrides)
    batch, low = cfg.ppo.num_prompts_per_step, cfg.async_rl.min_groups_for_streaming_train
    return [(f"min {low}", low), (f"min {batch // 2}", batch // 2), ("full batch", None)]


TIE = 0.02
"""Projections of streaming and full batch closer than this (of the full batch's) are a
tie: the same schedule, where which run measures faster is the runs' spread (2-10 %)."""

PER_SAMPLE = False
"""``--per-sample``: fit every sample alike, ignoring the recorded chunk widths."""

PROBES: dict[str, list[float]] = {}
"""Per profile: the seconds of :func:`_probe` before each of its runs and after the last."""


def _probe() -> float:
    """The machine's speed now: the median seconds of three passes of one fixed
    single-thread workload (the built-in task's policy, forward + backward + Adam step of
    256 rows of 20 tokens, four times). This 2-core VM runs the same work 20-50 % slower
    in some half-minutes than in others (its host is shared), so a calibration error
    under the probes' spread says nothing about the simulator."""
    import torch
    from ppo_trainer import ModelSpec, build_causal_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = ModelSpec(vocab_size=24, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         seed=0)  # fmt: skip
        model = build_causal_lm(spec)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 24, (256, 20), generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(4):
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
                opt.step()
                opt.zero_grad()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _predict(run: Path, *, skip: int, minimum: int, steps: int) -> float:
    from ppo_driver.simulate import fit_run
    from ppo_sampler import simulate

    fit = fit_run(run, skip_steps=skip, widths=not PER_SAMPLE)
    workload = fit.workload.with_min_groups(minimum)
    return simulate(
        workload, fit.generation, fit.costs, fit.lengths, steps=steps + 3, warmup_steps=1
    ).step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profiles",
        default=",".join(sorted(bench_driver.PROFILES)),
        help="bench_driver profiles, comma separated (default: all)",
    )
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first warms up)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this directory")
    parser.add_argument(
        "--refit", type=Path, default=None, help="no runs: fit and predict the runs kept there"
    )
    parser.add_argument(
        "--per-sample",
        action="store_true",
        help="fit costs per sample, ignoring the chunks' widths (to compare the two fits)",
    )
    args = parser.parse_args()
    global PER_SAMPLE
    PER_SAMPLE = args.per_sample
    if args.refit is not None:
        results, measured = _fit_and_predict(args.refit, args.profiles.split(","), args.steps)
        _report(results, measured, [os.getloadavg()[0]], 0.0)
        return
    profiles = args.profiles.split(",")
    for name in profiles:
        if name not in bench_driver.PROFILES:
            parser.error(f"--profiles: {name!r} is not one of {sorted(bench_driver.PROFILES)}")

    from ppo_placement import shutdown_local_ray, start_local_ray

    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    start_local_ray(num_gpus=2, num_cpus=4)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or Path(scratch)
        for index, profile in enumerate(profiles):
            overrides = bench_driver.PROFILES[profile]
            settings = _settings(overrides)
            shift = index % len(settings)
            order = settings[shift:] + settings[:shift]
            root = Path(tmp) / profile
            warm_steps = bench_driver.WARM_STEPS.get(profile, 0)
            warm = None
            if warm_steps:
                from ppo_driver.config import load_config

                defaults, _ = load_config(None, [])
                lrs = [f"{r}.lr={defaults.model(r).lr}" for r in ("policy", "critic")]
                bench_driver._run(
                    "full-batch",
                    [*overrides, *lrs],
                    warm_steps,
                    root / "warm",
                    streamed_micro_batches=False,
                )
                warm = root / "warm" / "full-batch"
            PROBES[profile] = []
            for _label, low in order:
                PROBES[profile].append(_probe())
                mode = "full-batch" if low is None else f"min{low}"
                extra = [] if low is None else [f"async_rl.min_groups_for_streaming_train={low}"]
                # the simulator's full batch: one micro-batch padded to the step's longest
                bench_driver._run(
                    mode,
                    [*overrides, *extra],
                    args.steps,
                    root,
                    warm=warm,
                    streamed_micro_batches=False,
                )
                load.append(os.getloadavg()[0])
            PROBES[profile].append(_probe())
        results, measured_all = _fit_and_predict(Path(tmp), profiles, args.steps)
    shutdown_local_ray()
    _report(results, measured_all, load, time.perf_counter() - t0)


Mark = Literal["yes", "NO", "tie", "-"]
"""Faster mode right? ("-": the pair has no full batch; "tie": projected within TIE)."""
Result = tuple[str, str, str, float, float, Mark]


def _fit_and_predict(
    tmp: Path, profiles: list[str], steps: int
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """For each profile's three runs under ``tmp``: the measured mean step time (steps
    after the first of the run), and each run's fit predicting the two others."""
    import json

    results: list[Result] = []
    measured_all: dict[str, dict[str, float]] = {}
    for profile in profiles:
        overrides = bench_driver.PROFILES[profile]
        skip = bench_driver.WARM_STEPS.get(profile, 0) + 1
        batch = _batch(overrides)
        lows = {label: (batch if low is None else low) for label, low in _settings(overrides)}
        runs: dict[str, Path] = {}
        measured: dict[str, float] = {}
        for label, low in lows.items():
            run = tmp / profile / ("full-batch" if low == batch else f"min{low}")
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            times = [r["perf/step_s"] for r in rows[skip:]]
            measured[label] = statistics.fmean(times)
            spread = statistics.stdev(times) / measured[label] if len(times) > 1 else 0.0
            chunks = [len(r["train/chunk_groups"]) for r in rows[skip:]]
            print(
                f"{profile} {label}: step_s {' '.join(f'{t:.2f}' for t in times)} "
                f"(spread {spread:.0%} of the mean), chunks {chunks}"
            )
            runs[label] = run
        measured_all[profile] = measured
        for fit_on, target in itertools.permutations(lows, 2):
            run = runs[fit_on]
            predicted = _predict(run, skip=skip, minimum=lows[target], steps=steps)
            # which is faster, streaming or full batch: only for a pair that has both; a
            # "tie" where the projections are within TIE of each other (the same schedule,
            # as a training-bound profile's one chunk a step: the runs' spread decides)
            faster: Mark = "-"
            if "full batch" in (fit_on, target):
                other = fit_on if target == "full batch" else target
                p_stream = _predict(run, skip=skip, minimum=lows[other], steps=steps)
                p_full = _predict(run, skip=skip, minimum=batch, steps=steps)
                if abs(p_full - p_stream) < TIE * p_full:
                    faster = "tie"
                else:
                    right = (p_stream < p_full) == (measured[other] < measured["full batch"])
                    faster = "yes" if right else "NO"
            results.append((profile, fit_on, target, measured[target], predicted, faster))
    return results, measured_all


def _batch(overrides: list[str]) -> int:
    from ppo_driver.config import load_config

    cfg, _ = load_config(None, overrides)
    return cfg.ppo.num_prompts_per_step


def _report(
    results: list[Result],
    measured: dict[str, dict[str, float]],
    load: list[float],
    seconds: float,
) -> None:
    print()
    print("measured mean s/step (steps 2..N of one run per setting):")
    for profile, by in measured.items():
        print(f"  {profile:<18} " + "  ".join(f"{k}: {v:.3f}" for k, v in by.items()))
    print()
    head = f"{'profile':<18} {'fitted on':<11} {'predicts':<11} {'measured':>9} {'predicted':>9}"
    print(head + f" {'error':>7}  faster mode right?")
    errors: dict[str, list[float]] = {}
    for profile, fit_on, target, meas, pred, faster in results:
        err = abs(pred - meas) / meas
        errors.setdefault(profile, []).append(err)
        print(
            f"{profile:<18} {fit_on:<11} {target:<11} {meas:>9.3f} {pred:>9.3f} {err:>7.1%}  "
            f"{faster}"
        )
    print()
    for profile, errs in errors.items():
        probes = PROBES.get(profile, [])
        speed = (
            f"; the machine's speed probe {min(probes):.3f}-{max(probes):.3f} s around its "
            f"runs (spread {max(probes) / min(probes) - 1:.0%})"
            if probes
            else ""
        )
        print(f"{profile:<18} mean error {statistics.fmean(errs):.1%}, max {max(errs):.1%}" + speed)
    marks = [f for *_, f in results if f != "-"]
    print(
        f"faster mode predicted right in {marks.count('yes')} of "
        f"{len(marks) - marks.count('tie')} fitted pairs ({marks.count('tie')} projected a tie: "
        f"within {TIE:.0%})"
    )
    print(
        f"load average (1 min) during the bench: {min(load):.1f} to {max(load):.1f} "
        f"on {os.cpu_count()} cores; total {seconds:.0f} s"
    )


if __name__ == "__main__":
    main()
