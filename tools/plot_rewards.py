"""The README's reward plot: mean reward per step of one or more finished runs.

Each argument is a run directory (``runs/<name>``, holding ``metrics.jsonl``), optionally
``DIR=LABEL``; runs with the same label are drawn in one colour (e.g. several seeds of
one config). Faint: ``rollout/reward_mean`` per step; bold: its 10-step running mean.
A dashed line marks 0.8. Prints each run's first-10 and last-10 step means.

The README's plot (``docs/reward.png``), after the runs its README section gives:

    uv run --frozen python tools/plot_rewards.py --out docs/reward.png --x seconds \\
        --title "built-in task: mean reward over training time" \\
        runs/bench/task-default-s{0,1,2,3,4}=streaming \\
        runs/bench/task-full-batch-s{0,1,2,3,4}=full-batch

Since the default and the full-batch config learn the same per step, bit for bit, their
curves over steps coincide; on this training-bound task, where the full batch does the
streamed step's work, over training seconds too, up to the load's noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WINDOW = 10


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def read_rewards(run_dir: Path) -> list[float]:
    return [float(r["rollout/reward_mean"]) for r in read_rows(run_dir)]


def step_seconds(run_dir: Path) -> list[float]:
    """Seconds of training at each step's end: the running sum of ``perf/step_s``."""
    total, out = 0.0, []
    for r in read_rows(run_dir):
        total += float(r["perf/step_s"])
        out.append(total)
    return out


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories, each optionally DIR=LABEL")
    parser.add_argument("--out", default="docs/reward.png")
    parser.add_argument("--title", default="built-in task: mean reward per step")
    parser.add_argument(
        "--steps", type=int, default=None, help="plot only the first STEPS steps of each run"
    )
    parser.add_argument(
        "--x",
        choices=["step", "seconds"],
        default="step",
        help="x axis: the step, or the seconds of training (the running sum of perf/step_s)",
    )
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    colours: dict[str, str] = {}
    labelled: set[str] = set()
    for spec in args.runs:
        path, _, label = spec.partition("=")
        label = label or Path(path).name
        rewards = read_rewards(Path(path))[: args.steps]
        colour = colours.setdefault(label, f"C{len(colours)}")
        steps = (
            range(len(rewards)) if args.x == "step" else step_seconds(Path(path))[: len(rewards)]
        )
        ax.plot(steps, rewards, color=colour, alpha=0.2, linewidth=0.8)
        ax.plot(
            steps,
            running_mean(rewards),
            color=colour,
            linewidth=1.8,
            label=None if label in labelled else label,
        )
        labelled.add(label)
        first = sum(rewards[:WINDOW]) / min(WINDOW, len(rewards))
        last = sum(rewards[-WINDOW:]) / min(WINDOW, len(rewards))
        print(
            f"{path}: {len(rewards)} steps, mean reward first 10 {first:.3f} -> last 10 {last:.3f}"
        )
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("step" if args.x == "step" else "seconds of training (sum of the step times)")
    ax.set_ylabel(f"mean reward ({WINDOW}-step running mean bold)")
    ax.set_ylim(0, 1)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
