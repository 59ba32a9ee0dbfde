"""Checkpoint atomicity, RNG round trip, metrics truncation on resume, trace and plot files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from ppo_driver.checkpoint import (
    find_latest,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from ppo_driver.cli import main
from ppo_driver.metrics import MetricsWriter, plot_rewards, read_metrics
from ppo_driver.trace import TraceRecorder


def _models(tmp: Path) -> None:
    (tmp / "actor").mkdir()
    (tmp / "actor" / "w.txt").write_text("weights")


class Crash(RuntimeError):
    pass


def _crash_at(point: str):  # type: ignore[no-untyped-def]
    def hook(where: str) -> None:
        if where == point:
            raise Crash(where)

    return hook


def test_save_is_atomic_and_latest_points_to_complete_checkpoints(tmp_path: Path) -> None:
    tensors = {"x": torch.arange(4.0)}
    first = save_checkpoint(tmp_path, 1, state={"a": 1}, tensors=tensors, write_models=_models)
    assert find_latest(tmp_path) == first
    data = load_checkpoint(first)
    assert data.step == 1 and data.state["a"] == 1 and torch.equal(data.tensors["x"], tensors["x"])
    for point in ("after_models", "before_rename"):
        with pytest.raises(Crash):
            save_checkpoint(
                tmp_path,
                2,
                state={"a": 2},
                tensors=tensors,
                write_models=_models,
                crash_hook=_crash_at(point),
            )
        assert (tmp_path / "step_000002.partial").is_dir()
        assert not (tmp_path / "step_000002").exists()
        assert find_latest(tmp_path) == first
    (tmp_path / "latest").unlink()  # even without the pointer, a partial one is never chosen
    assert find_latest(tmp_path) == first
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, step, state={}, tensors=tensors, write_models=_models, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]
    assert (tmp_path / "latest").read_text() == "step_000004"
    assert not list(tmp_path.glob("*.pickle")) and not list(tmp_path.rglob("*.pt"))


def test_rng_round_trip() -> None:
    random.seed(3)
    torch.manual_seed(3)
    state, tensors = rng_state()
    a = (random.random(), torch.rand(3))
    json.dumps(state)  # JSON-serialisable, no pickle
    restore_rng(state, tensors)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_metrics_truncated_to_checkpoint_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in range(4):
        writer.write({"step": step, "rollout/reward_mean": 0.1 * step, "x": float("nan")})
    writer.close()
    writer = MetricsWriter(path, keep_steps_below=2)  # resume from a checkpoint after 2 steps
    writer.write({"step": 2, "rollout/reward_mean": 0.5})
    writer.close()
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["x"] is None
    png = plot_rewards(rows, tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_is_chrome_trace_json(tmp_path: Path) -> None:
    trace = TraceRecorder()
    with trace.span("chunk 1", step=0, phase="chunk"):
        pass
    trace.add(
        "generation step 0",
        start_s=trace.origin,
        end_s=trace.origin + 0.5,
        track="generation",
        step=0,
        phase="generation",
    )
    out = json.loads(trace.write(tmp_path / "trace.json").read_text())
    events = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in events} == {"chunk", "generation"}
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    assert trace.take_step_totals()["generation"] == pytest.approx(0.5)


def test_cli_help_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--resume" in out and "--config" in out
