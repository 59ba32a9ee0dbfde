"""Learning speed: the project's ``ppo-driver train`` run against a minimal single-process
PPO loop (``bench/minimal_ppo.py``), same task, models, initial weights and
hyper-parameters, same seeds, in one run.

For each seed the two are run back to back (the order alternates from seed to seed, so
that drifting machine load hits both alike) and compared on the 10-step running mean of
``rollout/reward_mean``:

* reward at equal steps (at 25 %, 50 % and 100 % of the run);
* reward at equal wall time (the reward each had reached when the FASTER of the two
  finished, and at half that time); wall time counts from the call that starts the run
  (the project's includes starting Ray, the workers and the engine);
* steps and seconds to reach 0.8, and the ratio project / minimal loop of the time to
  0.8 (lower is better: the project pays for Ray, the model switches and the refits, and
  gains from streaming and the batched engine).

The config is the project's default (``ppo-driver train`` with no arguments) unless
``--config`` names another YAML (e.g. ``configs/full_batch.yaml``, the one that reaches
0.8 in a few minutes) or overrides are given. The load average is printed with every
run: wall times on a loaded machine are inflated.

    uv run --frozen python bench/bench_learning.py [--seeds 0 1 2] [--config PATH] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # minimal_ppo.py, beside this file

import minimal_ppo

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
    from ppo_driver.run import train

    times: list[float] = []
    start = time.perf_counter()
    result = train(
        cfg,
        run_dir=root,
        overwrite=True,  # a --runs-dir kept from an earlier bench
        keep_ray=False,
        on_step=lambda _report: times.append(time.perf_counter() - start),
    )
    rewards = [float(m["rollout/reward_mean"]) for m in result.metrics]
    chunks = [int(m["train/chunks"]) for m in result.metrics]
    return {"rewards": rewards, "times": times, "chunks": chunks}


def run_minimal(cfg: Any) -> dict[str, Any]:
    args = minimal_ppo.Args.from_driver_config(cfg, log=False)
    start = time.perf_counter()
    times: list[float] = []
    history = minimal_ppo.run(args, on_step=lambda _row: times.append(time.perf_counter() - start))
    return {"rewards": [float(r["rollout/reward_mean"]) for r in history], "times": times}


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
        "wall_s": run["times"][-1],
    }


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default=None, help="a YAML config (default: the defaults)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="keep the project's run directories here (<name>-s<seed>: metrics.jsonl, "
        "reward.png, ...), e.g. for tools/plot_rewards.py; default: a temporary directory",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. run.num_steps=100")
    args = parser.parse_args()

    from ppo_driver.config import load_config

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = Path(args.runs_dir) if args.runs_dir else Path(tmp)
        for k, seed in enumerate(args.seeds):
            cfg, _ = load_config(
                args.config, [*args.overrides, f"run.seed={seed}", "run.checkpoint_every=0"]
            )
            cfg.run.progress = False
            order = ("project", "minimal") if k % 2 == 0 else ("minimal", "project")
            row: dict[str, Any] = {"seed": seed}
            for name in order:
                load = os.getloadavg()[0]
                run = (
                    run_project(cfg, runs_dir / f"{cfg.run.name}-s{seed}")
                    if name == "project"
                    else run_minimal(cfg)
                )
                row[name] = {
                    **summarize(run),
                    "load_before": load,
                    "load_after": os.getloadavg()[0],
                }
                if name == "project":
                    chunks = run["chunks"]
                    row[name]["multi_chunk_share"] = sum(c > 1 for c in chunks) / len(chunks)
                print(
                    f"seed {seed} {name:<8} wall {row[name]['wall_s']:6.1f} s  reward "
                    f"{row[name]['first10']:.3f} -> {row[name]['last10']:.3f}  load "
                    f"{load:.2f} -> {row[name]['load_after']:.2f}",
                    flush=True,
                )
            results.append(row)

    mode = "streaming" if cfg.streaming else "full-batch"
    print()
    print(
        f"config: {args.config or 'defaults'} {' '.join(args.overrides)} ({mode}, "
        f"{cfg.ppo.num_prompts_per_step} x {cfg.ppo.num_generations_per_prompt} per step, "
        f"{cfg.run.num_steps} steps); reward = {WINDOW}-step running mean"
    )
    head = (
        f"{'seed':>4} {'run':<8} {'first10':>7} {'@25%':>6} {'@50%':>6} {'@100%':>6} "
        f"{'wall_s':>7} {'@t/2':>6} {'@t':>6} {'steps->0.8':>10} {'s->0.8':>7}"
    )
    print(head)
    ratios = []
    for row in results:
        p, m = row["project"], row["minimal"]
        t = min(p["wall_s"], m["wall_s"])  # equal wall time: the faster one's end
        for name, s in (("project", p), ("minimal", m)):
            print(
                f"{row['seed']:>4} {name:<8} {s['first10']:>7.3f} "
                + " ".join(f"{v:>6.3f}" for v in s["at_steps"].values())
                + f" {s['wall_s']:>7.1f} {_fmt(at_time(s['times'], s['curve'], t / 2)):>6} "
                f"{_fmt(at_time(s['times'], s['curve'], t)):>6} "
                f"{_fmt(s['steps_to_target'], 'd'):>10} {_fmt(s['time_to_target'], '.1f'):>7}"
            )
        if p["time_to_target"] is not None and m["time_to_target"] is not None:
            ratios.append(p["time_to_target"] / m["time_to_target"])
        share = p.get("multi_chunk_share")
        if share is not None:
            print(f"     project: steps with more than one chunk {share:.0%}")
    print()
    if ratios:
        print(
            f"time to {TARGET} project / minimal loop: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + f" (mean {statistics.mean(ratios):.2f}; lower is better)"
        )
    else:
        print(f"time to {TARGET}: not reached by both in any seed (no ratio)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
