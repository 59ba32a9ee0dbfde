"""``run.tensorboard``: every numeric metric of every step as a TensorBoard scalar, read
back with TensorBoard's own reader (``EventAccumulator``); the validation of the key; and
the real CLI writing event files beside ``metrics.jsonl`` (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from driver_testlib import TINY_RUN
from ppo_driver import _machine as config_mod
from ppo_driver.config import load_config
from ppo_driver.metrics import TENSORBOARD_DIR, MetricsWriter, read_metrics

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="needs the extra ppo-driver[tensorboard] (uv sync --extra tensorboard)",
)


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _row(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "rollout/reward_mean": 0.25 * step,
        "train/chunks": 3,
        "perf/step_s": 1.5 + step,
        "loss/value": float("nan"),
        "run/mode": "streaming",  # not a number: not a scalar
        "eval/reward_mean": None,  # no value this step
        "train/flag": True,  # a boolean is not a metric value
    }


@needs_tensorboard
def test_every_numeric_metric_is_a_scalar_per_step(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tb")
    for step in range(3):
        writer.write(_row(step))
        # flushed per step: a running TensorBoard sees the step before the run ends
        assert _scalars(tmp_path / "tb")["perf/step_s"][-1] == (step, 1.5 + step)
    writer.close()
    writer.close()  # idempotent
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) == {"rollout/reward_mean", "train/chunks", "perf/step_s", "loss/value"}
    assert scalars["rollout/reward_mean"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert scalars["train/chunks"] == [(0, 3.0), (1, 3.0), (2, 3.0)]
    assert all(math.isnan(v) for _, v in scalars["loss/value"])
    # the JSONL file is written as before
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_without_tensorboard_dir_no_event_files(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.write(_row(0))
    writer.close()
    assert writer.tensorboard is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@needs_tensorboard
def test_resume_purges_the_steps_trained_again(tmp_path: Path) -> None:
    """A run crashed after step 3 with a checkpoint at 2 steps: the resumed run writes
    steps 2.. again; TensorBoard shows each step once, with the new values."""
    first = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tb")
    for step in range(4):
        first.write(_row(step))
    first.close()
    resumed = MetricsWriter(
        tmp_path / "metrics.jsonl", keep_steps_below=2, tensorboard_dir=tmp_path / "tb"
    )
    for step in (2, 3, 4):
        resumed.write({**_row(step), "rollout/reward_mean": 10.0 + step})
    resumed.close()
    assert _scalars(tmp_path / "tb")["rollout/reward_mean"] == [
        (0, 0.0),
        (1, 0.25),
        (2, 12.0),
        (3, 13.0),
        (4, 14.0),
    ]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_validate_refuses_tensorboard_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = config_mod.module_available
    monkeypatch.setattr(
        config_mod, "module_available", lambda name: name != "tensorboard" and real(name)
    )
    _, report = load_config(None, ["run.tensorboard=true"], check=False)
    assert len(report.errors) == 1, report.errors
    (error,) = report.errors
    assert error.key == "run.tensorboard" and error.value is True
    assert "tensorboard package" in error.message
    assert "ppo-driver[tensorboard]" in error.fix and "run.tensorboard=false" in error.fix
    # off (the default): nothing is needed
    _, report = load_config(None, [], check=False)
    assert report.errors == []


@needs_tensorboard
def test_validate_accepts_tensorboard_where_it_is_installed() -> None:
    _, report = load_config(None, ["run.tensorboard=true"], check=False)
    assert report.errors == []


@pytest.mark.slow
@needs_tensorboard
@pytest.mark.timeout(1200)
def test_cli_run_writes_event_files_with_every_metric(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny"
    cmd = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--no-progress", "run.tensorboard=true", "run.num_steps=2", *TINY_RUN]
    cmd += ["rollout.max_new_tokens=8"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PPO_DRIVER_FAIL_AT")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "step 1 | reward=" in proc.stderr  # the console line stays
    assert f"TensorBoard event files in {run_dir / TENSORBOARD_DIR}" in proc.stderr
    scalars = _scalars(run_dir / TENSORBOARD_DIR)  # what `tensorboard --logdir` shows
    numeric = {
        key
        for row in rows
        for key, value in row.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }
    assert numeric and numeric <= set(scalars), sorted(numeric - set(scalars))
    for key in numeric:
        want = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
        got = [(s, v) for s, v in scalars[key] if math.isfinite(v)]  # JSONL: null for NaN
        assert [s for s, _ in got] == [s for s, _ in want], key
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-6), key  # float32 in the event file
