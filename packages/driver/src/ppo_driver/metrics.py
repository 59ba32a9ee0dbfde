"""Per-step metrics: one JSON line per step, TensorBoard event files (optional), a console
line, and the reward plot."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ppo_driver._json import JSONObject, as_float, as_int

__all__ = [
    "TENSORBOARD_DIR",
    "MetricsWriter",
    "NonFiniteError",
    "TensorBoardWriter",
    "check_finite_metrics",
    "format_step_line",
    "plot_rewards",
    "read_metrics",
]

TENSORBOARD_DIR = "tensorboard"
"""In the run directory: the TensorBoard event files (``run.tensorboard: true``), so that
``tensorboard --logdir runs/`` lists each run as ``<name>/tensorboard``."""


def _clean(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per completed step to ``metrics.jsonl``, and with
    ``tensorboard_dir`` every numeric metric of it to TensorBoard event files there
    (:class:`TensorBoardWriter`).

    On resume the file is truncated to the steps the checkpoint covers, so no step is
    ever recorded twice (TensorBoard: the steps from ``keep_steps_below`` on, written by
    the run before, are purged from its view).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        keep_steps_below: int | None = None,
        tensorboard_dir: str | Path | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_steps_below is not None and self.path.exists():
            kept = [
                r for r in read_metrics(self.path) if as_int(r.get("step", -1)) < keep_steps_below
            ]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        elif keep_steps_below is None and self.path.exists():
            self.path.unlink()
        self._fh: TextIO | None = self.path.open("a")
        self.tensorboard = (
            None
            if tensorboard_dir is None
            else TensorBoardWriter(tensorboard_dir, purge_step=keep_steps_below)
        )

    def write(self, record: Mapping[str, object]) -> None:
        assert self._fh is not None, "writer closed"
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.tensorboard is not None:
            self.tensorboard.close()


class TensorBoardWriter:
    """Every numeric metric of a step record as a TensorBoard scalar: the tag is the
    metric's key (``rollout/reward_mean``: TensorBoard groups tags by the part before the
    ``/``), the x value the record's ``step``. Non-numeric values (strings, ``None``) and
    booleans are left out; NaN and infinity are written as they are.

    Needs the ``tensorboard`` package (the extra ``ppo-driver[tensorboard]``), imported
    here only, when a writer is made. Flushed after every step, so a running
    ``tensorboard --logdir`` shows each step as it completes.

    Args:
        log_dir: where the event files go (created if missing).
        purge_step: on resume, the first step this run writes: TensorBoard hides what
            earlier event files in ``log_dir`` recorded from this step on (a crashed run's
            steps past its last checkpoint, trained again now).
    """

    def __init__(self, log_dir: str | Path, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def write(self, record: Mapping[str, object]) -> None:
        assert self._writer is not None, "writer closed"
        step = as_int(record["step"])
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            self._writer.add_scalar(key, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_metrics(path: str | Path) -> list[JSONObject]:
    rows: list[JSONObject] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_step_line(record: Mapping[str, object]) -> str:
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
    rows: Sequence[Mapping[str, object]], path: str | Path, *, title: str = "mean reward"
) -> Path:
    """Write a PNG of the mean reward per step (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [as_int(r["step"]) for r in rows if r.get("rollout/reward_mean") is not None]
    rewards = [
        as_float(r["rollout/reward_mean"]) for r in rows if r.get("rollout/reward_mean") is not None
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


class NonFiniteError(FloatingPointError):
    """A step produced a non-finite loss, gradient norm or metric; the step is not
    recorded or checkpointed (the workers refuse the optimizer step itself)."""

    def __init__(self, step: int, detail: str) -> None:
        self.step = step
        super().__init__(f"step {step}: {detail}")


def check_finite_metrics(step: int, metrics: Mapping[str, object]) -> None:
    """Refuse a step whose numbers are not all finite (a NaN or inf is never dropped or
    written as a gap): raises :class:`NonFiniteError` naming the step and every key
    (list values, e.g. per-chunk numbers, are checked element by element)."""
    bad = {k: v for k, v in _numbers(metrics) if not math.isfinite(v)}
    if bad:
        listed = ", ".join(f"{k} = {v!r}" for k, v in sorted(bad.items()))
        raise NonFiniteError(step, f"non-finite metric(s): {listed}; the step is not recorded")


def _numbers(metrics: Mapping[str, object]) -> Iterator[tuple[str, float]]:
    for k, v in metrics.items():
        values = v if isinstance(v, list) else [v]
        for i, x in enumerate(values):
            if isinstance(x, int | float) and not isinstance(x, bool):
                yield (k if len(values) == 1 and not isinstance(v, list) else f"{k}[{i}]"), x
