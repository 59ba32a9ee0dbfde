"""Per-step metrics: one JSON line per step, a console line, and the reward plot."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsWriter", "format_step_line", "plot_rewards", "read_metrics"]


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per completed step to ``metrics.jsonl``.

    On resume the file is truncated to the steps the checkpoint covers, so no step is
    ever recorded twice.
    """

    def __init__(self, path: str | Path, *, keep_steps_below: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_steps_below is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if int(r.get("step", -1)) < keep_steps_below]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        elif keep_steps_below is None and self.path.exists():
            self.path.unlink()
        self._fh: TextIO | None = self.path.open("a")

    def write(self, record: Mapping[str, Any]) -> None:
        assert self._fh is not None, "writer closed"
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_step_line(record: Mapping[str, Any]) -> str:
    """The console line of one step: reward, KL, clip fraction, value loss, chunks, times."""
    keys = (
        ("reward", "rollout/reward_mean"),
        ("kl", "actor/approx_kl"),
        ("kl_eng", "rollout/kl_engine_trainer"),
        ("clipfrac", "actor/clipfrac"),
        ("v_loss", "loss/value"),
        ("chunks", "train/chunks"),
        ("step_s", "perf/step_s"),
        ("wait_s", "perf/wait_s"),
        ("chunks_s", "perf/chunks_s"),
        ("update_s", "perf/update_s"),
        ("refit_s", "perf/refit_s"),
        ("critic_s", "perf/critic_s"),
    )
    parts = [f"step {record.get('step')}"]
    parts += [
        f"{short}={_fmt(record[key])}"
        for short, key in keys
        if key in record and record[key] is not None
    ]
    return " | ".join(parts)


def plot_rewards(
    rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "mean reward"
) -> Path:
    """Write a PNG of the mean reward per step (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows if r.get("rollout/reward_mean") is not None]
    rewards = [
        float(r["rollout/reward_mean"]) for r in rows if r.get("rollout/reward_mean") is not None
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, marker="o", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
