"""Learning speed: the streaming default (``ppo-driver train``), the full-batch config
(``configs/full_batch.yaml``: the same settings, minimum = batch) and a minimal
single-process PPO loop (``bench/minimal_ppo.py``, same task, models, initial weights and
hyper-parameters, policy epochs included), same seeds, in one run.

For each seed the runs go back to back, in an order that rotates from seed to seed (so
that drifting machine load hits all alike), each in a fresh Python process (as a user
starts it: nothing imported or warmed by an earlier run), and are compared on the
10-step running mean of ``rollout/reward_mean``: steps and wall seconds to 0.8, the
reward at equal steps, and the last-10 mean. Wall seconds count from the process's
start (Python, the imports: the project's driver modules or the minimal loop's torch,
then starting Ray, the workers and the engine, or building the models), and, as a
second clock, from the call that starts the run (``train()`` / ``minimal_ppo.run()``,
the imports done). Ratios of the time to 0.8, on both clocks (lower is better), and of
the wall seconds per step after step 5 (what the time to 0.8 approaches when two runs
take the same steps, without the start-up both pay).

Profiles (``--profile``):

* ``task`` (default): the built-in task as ``ppo-driver train`` runs it. On two CPU
  cores it is training-bound (in full-batch mode the next step's generation is done
  before the step starts), so streaming saves only the forward it fuses.
* ``generation-bound``: generation on devices of its own, emulated by
  ``rollout.decode_delay_s`` (the engine sleeps 0.1 s per decode step, off the trainers'
  cores, as ``bench_driver``'s ``separate``); 80 steps. Streaming trains the chunks that
  are done while the rest generates. The default (here fixed blocks in length order:
  ``async_rl.deterministic_chunks`` and ``async_rl.block_order`` null with a decode
  delay; it learns what the full batch learns bit for bit), the default with its chunks
  cut as groups arrive (``by-arrival``: ``async_rl.deterministic_chunks=false``, the
  default before ppo-driver 0.8.1) and the full batch (its rows in the same length
  order; the minimal loop has no separate generation); default / full batch and
  by-arrival / full batch.

Any further overrides apply to every project run (and the minimal loop's settings).
The load average is printed with every run: wall times on a loaded machine are inflated.
Before the first measured run, one short project run (``--warmup-steps``, 3; 0: none) is
left out of the comparison: the first run on a machine that has been idle reads the
libraries from disk, and whichever config the rotation puts first would pay for it.

A busy machine (``--load``), held for the whole benchmark:

* ``spin``: a busy loop on one core (``python -c "while True: pass"``);
* ``train``: another ``ppo-driver train`` beside the runs (the built-in task with
  ``policy.lr=1e-9``, so that the policy, its response lengths and so its load stay the
  same all along; a learning job is heaviest in its first minutes and would weigh most
  on whichever run comes first). Its steps per second during each run are printed with
  the run (``beside``): the same value for two runs means they had the same machine.

    uv run --frozen python bench/bench_learning.py [--profile task] [--seeds 0 1 2 3 4] [--load spin|train] [overrides ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # minimal_ppo.py, beside this file

TARGET = 0.8
WINDOW = 10


def running_mean(rewards: list[float], window: int = WINDOW) -> list[float]:
    """The mean of the last ``window`` values at every step (fewer at the start)."""
    out = []
    for i in range(len(rewards)):
        part = rewards[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def first_reach(curve: list[float], *, target: float = TARGET) -> int | None:
    """The first step whose full ``WINDOW``-step mean reaches ``target``."""
    return next((i for i, m in enumerate(curve) if i >= WINDOW - 1 and m >= target), None)


def at_time(times: list[float], curve: list[float], t: float) -> float | None:
    """The running mean at the last step finished by wall time ``t`` (None: none yet)."""
    done = [i for i, s in enumerate(times) if s <= t]
    return curve[done[-1]] if done else None


def run_project(cfg: Any, root: Path) -> dict[str, Any]:
    """In the run's own process: ``train()``; wall-clock stamps (``time.time()``) of the
    call and of every step's end."""
    from ppo_driver.run import train

    stamps: list[float] = []
    called = time.time()
    result = train(
        cfg,
        run_dir=root,
        overwrite=True,  # a --runs-dir kept from an earlier bench
        keep_ray=False,
        on_step=lambda _report: stamps.append(time.time()),
    )
    rewards = [float(m["rollout/reward_mean"]) for m in result.metrics]
    chunks = [int(m["train/chunks"]) for m in result.metrics]
    return {"rewards": rewards, "called": called, "stamps": stamps, "chunks": chunks}


def run_minimal(cfg: Any) -> dict[str, Any]:
    """In the run's own process: ``minimal_ppo.run()``, stamped as :func:`run_project`."""
    import minimal_ppo

    args = minimal_ppo.Args.from_driver_config(cfg, log=False)
    stamps: list[float] = []
    called = time.time()
    history = minimal_ppo.run(args, on_step=lambda _row: stamps.append(time.time()))
    rewards = [float(r["rollout/reward_mean"]) for r in history]
    return {"rewards": rewards, "called": called, "stamps": stamps}


def load_run_config(name: str, seed: int, overrides: list[str]) -> Any:
    from ppo_driver.config import load_config

    cfg, report = load_config(
        FULL_BATCH if name == "full-batch" else None,
        [*overrides, *RUN_OVERRIDES.get(name, []), f"run.seed={seed}", "run.checkpoint_every=0"],
    )
    assert report.ok, report
    cfg.run.progress = False
    return cfg


def child(argv: list[str]) -> None:
    """``--child NAME SEED OUT RUN_DIR [overrides]``: one run, its result to OUT."""
    name, seed, out, run_dir, *overrides = argv
    cfg = load_run_config(name, int(seed), overrides)
    run = run_minimal(cfg) if name == "minimal" else run_project(cfg, Path(run_dir))
    Path(out).write_text(json.dumps(run))


def spawn_run(name: str, seed: int, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One run in a fresh process; ``times``: seconds from the process's start to each
    step's end, ``times_call``: from the call that starts the run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        argv = [sys.executable, __file__, "--child", name, str(seed), str(out), str(run_dir)]
        started = time.time()
        subprocess.run([*argv, *overrides], check=True)
        run = json.loads(out.read_text())
    run["times"] = [t - started for t in run["stamps"]]
    run["times_call"] = [t - run["called"] for t in run["stamps"]]
    return run


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    curve = running_mean(run["rewards"])
    reach = first_reach(curve)
    n = len(curve)
    return {
        "curve": curve,
        "times": run["times"],
        "first10": sum(run["rewards"][:WINDOW]) / min(WINDOW, n),
        "last10": curve[-1],
        "at_steps": {f"{p}%": curve[max(0, n * p // 100 - 1)] for p in (25, 50, 100)},
        "steps_to_target": reach,
        "time_to_target": run["times"][reach] if reach is not None else None,
        "time_to_target_call": run["times_call"][reach] if reach is not None else None,
        "first_step_s": run["times"][0],
        "first_step_call_s": run["times_call"][0],
        "wall_s": run["times"][-1],
        "mean_step_s": mean_step(run["times"]),
    }


def mean_step(times: list[float], *, skip: int = 5) -> float | None:
    """Mean wall seconds between step ends after the first ``skip`` steps (start-up and
    warm-up left out): the per-step cost that time to the target approaches when two
    runs take the same steps."""
    gaps = [b - a for a, b in itertools.pairwise(times[skip:])]
    return statistics.mean(gaps) if gaps else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


FULL_BATCH = Path(__file__).parents[1] / "packages/driver/src/ppo_driver/configs/full_batch.yaml"
PROFILES: dict[str, list[str]] = {
    "task": [],
    "generation-bound": ["rollout.decode_delay_s=0.1", "run.num_steps=80"],
}
# the runs of each profile; each is compared with the other runs named in RATIOS
RUNS = {
    "task": ["default", "full-batch", "minimal"],
    "generation-bound": ["default", "by-arrival", "full-batch"],
}
RATIOS = {
    "task": [("default", "full-batch"), ("default", "minimal")],
    "generation-bound": [("default", "full-batch"), ("by-arrival", "full-batch")],
}
# by-arrival: the default with its chunks cut as groups arrive (with generation on
# devices of its own the default cuts fixed blocks in length order)
RUN_OVERRIDES = {"by-arrival": ["async_rl.deterministic_chunks=false"]}


# the --load train job's settings: the built-in task, never learning (a stationary load)
LOAD_TRAIN = ["run.num_steps=1000000", "run.checkpoint_every=0", "policy.lr=1e-9"]


class Load:
    """The ``--load`` process, started before the first run and stopped after the last
    (``none``: nothing)."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.metrics = directory / "load" / "metrics.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None
        if kind == "spin":
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        elif kind == "train":
            cli = [sys.executable, "-m", "ppo_driver.cli", "train", *LOAD_TRAIN]
            where = [f"run.output_dir={directory}", "run.name=load", "run.progress=false"]
            self.proc = subprocess.Popen(
                [*cli, *where], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                self._wait_for_steps(10)  # past its start-up: its steady load from here on
            except BaseException:
                self.stop()
                raise

    def steps(self) -> int | None:
        """Steps the beside job has finished (None: no beside job)."""
        if self.kind != "train":
            return None
        try:
            return sum(1 for _ in self.metrics.open())
        except FileNotFoundError:
            return 0

    def _wait_for_steps(self, n: int) -> None:
        deadline = time.monotonic() + 600
        while (self.steps() or 0) < n:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the --load train job exited ({self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the --load train job made no {n} steps in 600 s")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # train stops at the end of its step and tears its Ray cluster down on SIGINT
        self.proc.send_signal(signal.SIGINT if self.kind == "train" else signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="task")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="keep the project's run directories here (<run>-s<seed>: metrics.jsonl, "
        "reward.png, ...), e.g. for tools/plot_rewards.py; default: a temporary directory",
    )
    parser.add_argument(
        "--load",
        choices=["none", "spin", "train"],
        default="none",
        help="a busy machine for the whole benchmark: a busy loop on one core (spin) or "
        "another ppo-driver train beside the runs (train)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=3,
        help="steps of one unmeasured project run before the first measured one (0: none)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. run.num_steps=100")
    args = parser.parse_args()

    overrides = [*PROFILES[args.profile], *args.overrides]
    names = RUNS[args.profile]
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = Path(args.runs_dir) if args.runs_dir else Path(tmp)
        load_job = Load(args.load, Path(tmp))
        try:
            results = _run_all(args, names, overrides, runs_dir, load_job)
        finally:
            load_job.stop()
    _report(args, names, overrides, results)


def _run_all(
    args: argparse.Namespace,
    names: list[str],
    overrides: list[str],
    runs_dir: Path,
    load_job: Load,
) -> list[dict[str, Any]]:
    """Every seed's runs, in rotating order: one row per seed."""
    if args.warmup_steps > 0:
        began = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            spawn_run(
                "default",
                args.seeds[0],
                [*overrides, f"run.num_steps={args.warmup_steps}"],
                Path(tmp),
            )
        print(
            f"warm-up run ({args.warmup_steps} steps, not measured): "
            f"{time.monotonic() - began:.1f} s",
            flush=True,
        )
    results: list[dict[str, Any]] = []
    for k, seed in enumerate(args.seeds):
        row: dict[str, Any] = {"seed": seed}
        for name in names[k % len(names) :] + names[: k % len(names)]:
            load = os.getloadavg()[0]
            beside = load_job.steps()
            run_dir = runs_dir / f"{args.profile}-{name}-s{seed}"
            began = time.monotonic()
            run = spawn_run(name, seed, overrides, run_dir)
            elapsed = time.monotonic() - began
            row[name] = {**summarize(run), "load_before": load, "load_after": os.getloadavg()[0]}
            after = load_job.steps()
            if beside is not None and after is not None:  # the beside job's pace meanwhile
                row[name]["beside_steps_per_s"] = (after - beside) / elapsed
            if "chunks" in run:
                row[name]["multi_chunk_share"] = sum(c > 1 for c in run["chunks"]) / len(
                    run["chunks"]
                )
            s = row[name]
            pace = s.get("beside_steps_per_s")
            print(
                f"seed {seed} {name:<10} wall {s['wall_s']:6.1f} s  reward "
                f"{s['first10']:.3f} -> {s['last10']:.3f}  0.8 at step "
                f"{_fmt(s['steps_to_target'], 'd')} / {_fmt(s['time_to_target'], '.1f')} s "
                f"({_fmt(s['time_to_target_call'], '.1f')} s from the call)  first step "
                f"{s['first_step_s']:.1f} s ({s['first_step_call_s']:.1f})  "
                f"load {load:.2f} -> {s['load_after']:.2f}"
                + ("" if pace is None else f"  beside {pace:.2f} steps/s"),
                flush=True,
            )
        results.append(row)
    return results


def _report(
    args: argparse.Namespace, names: list[str], overrides: list[str], results: list[dict[str, Any]]
) -> None:
    """The table, the ratios per seed and their means."""
    cfg = load_run_config("default", args.seeds[0], overrides)
    print()
    print(
        f"profile {args.profile} {' '.join(args.overrides)}: {cfg.run.num_steps} steps of "
        f"{cfg.ppo.num_prompts_per_step} x {cfg.ppo.num_generations_per_prompt}, "
        f"{cfg.ppo.ppo_epochs} policy epochs; reward = {WINDOW}-step running mean"
    )
    print(
        f"{'seed':>4} {'run':<10} {'first10':>7} {'@25%':>6} {'@50%':>6} {'@100%':>6} "
        f"{'wall_s':>7} {'steps->0.8':>10} {'s->0.8':>7} {'step_s':>6} {'multi-chunk':>11}"
    )
    ratios: dict[tuple[str, str, str], list[float]] = {
        (run, other, clock): [] for clock in ("", "_call") for run, other in RATIOS[args.profile]
    }
    for row in results:
        for name in names:
            s = row[name]
            share = s.get("multi_chunk_share")
            print(
                f"{row['seed']:>4} {name:<10} {s['first10']:>7.3f} "
                + " ".join(f"{v:>6.3f}" for v in s["at_steps"].values())
                + f" {s['wall_s']:>7.1f} {_fmt(s['steps_to_target'], 'd'):>10} "
                f"{_fmt(s['time_to_target'], '.1f'):>7} {_fmt(s['mean_step_s']):>6} "
                f"{_fmt(share, '.0%'):>11}"
            )
        for run, other, clock in ratios:
            a = row[run][f"time_to_target{clock}"]
            b = row[other][f"time_to_target{clock}"]
            if a is not None and b is not None:
                ratios[run, other, clock].append(a / b)
    print()
    reached = sum(row["default"]["steps_to_target"] is not None for row in results)
    print(f"default job reached {TARGET}: {reached} of {len(results)} seeds")
    for (run, other, clock), values in ratios.items():
        since = "the call" if clock else "the process's start"
        if values:
            print(
                f"time to {TARGET} (from {since}) {run} / {other}: "
                + ", ".join(f"{r:.2f}" for r in values)
                + f" (mean {statistics.mean(values):.2f}, max {max(values):.2f}; lower is better)"
            )
        else:
            print(
                f"time to {TARGET} (from {since}) {run} / {other}: not reached by both in any seed"
            )
    for run, other in RATIOS[args.profile]:
        steps = [(row[run]["mean_step_s"], row[other]["mean_step_s"]) for row in results]
        values = [a / b for a, b in steps if a is not None and b is not None]
        if values:
            print(
                f"wall seconds per step after step 5, {run} / {other}: "
                + ", ".join(f"{r:.3f}" for r in values)
                + f" (mean {statistics.mean(values):.3f}; what time to {TARGET} approaches "
                "when both take the same steps)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
