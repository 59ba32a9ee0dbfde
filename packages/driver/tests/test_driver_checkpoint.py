"""Checkpoint atomicity and integrity (manifest), RNG round trip, metrics truncation on
resume, trace and plot files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from ppo_driver._resume import _checkpoint_to_resume
from ppo_driver.checkpoint import (
    MANIFEST,
    CheckpointDamaged,
    find_latest,
    input_fingerprint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from ppo_driver.cli import main
from ppo_driver.config import DriverConfig, load_config
from ppo_driver.metrics import MetricsWriter, plot_rewards, read_metrics
from ppo_driver.run import resume_config_changes, resume_inputs
from ppo_driver.startup import StartupError
from ppo_driver.trace import TraceRecorder
from ppo_trainer.testing import rounding_bound
from safetensors.torch import save_file


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
    # (origin + 0.5) - origin in float64: two roundings at the scale of perf_counter()
    within = rounding_bound(terms=2, magnitude=trace.origin + 0.5, dtype=torch.float64)
    assert trace.take_step_totals()["generation"] == pytest.approx(0.5, rel=0, abs=within)


def test_cli_help_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--resume" in out and "--config" in out


def _worker_files(tmp: Path) -> None:
    """A worker's files as ppo_trainer writes them: state.json + state.safetensors."""
    rank = tmp / "actor" / "rank00000"
    rank.mkdir(parents=True)
    (rank / "state.json").write_text('{"format": 1}')
    save_file({"w": torch.arange(6.0)}, str(rank / "state.safetensors"))


def test_manifest_is_written_last_and_verify_names_the_damaged_file(tmp_path: Path) -> None:
    """Issue 11: damage (truncation, garbage) is found before anything reads the files."""
    seen: list[list[str]] = []

    def watch(point: str) -> None:
        if point == "before_rename":
            seen.append(sorted(p.name for p in (tmp_path / "step_000001.partial").iterdir()))

    ckpt = save_checkpoint(
        tmp_path,
        1,
        state={"a": 1},
        tensors={"x": torch.arange(4.0)},
        write_models=_worker_files,
        crash_hook=watch,
    )
    assert seen == [["actor", "driver.json", MANIFEST, "tensors.safetensors"]]
    listed = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert set(listed) == {
        "actor/rank00000/state.json",
        "actor/rank00000/state.safetensors",
        "driver.json",
        "tensors.safetensors",
    }
    assert verify_checkpoint(ckpt) is True

    weights = ckpt / "actor" / "rank00000" / "state.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-3])  # truncated
    with pytest.raises(CheckpointDamaged, match="the manifest says") as info:
        verify_checkpoint(ckpt)
    assert info.value.file == weights
    weights.write_bytes(intact[:-3] + b"abc")  # same size, other bytes
    with pytest.raises(CheckpointDamaged, match=r"contents differ from the manifest \(sha256\)"):
        verify_checkpoint(ckpt)
    weights.write_bytes(intact)
    (ckpt / "driver.json").write_text("garbage")
    with pytest.raises(CheckpointDamaged) as info:
        load_checkpoint(ckpt)  # a loader error names the file too
    assert info.value.file == ckpt / "driver.json" and "not readable JSON" in str(info.value)


def test_checkpoint_without_manifest_gets_a_structural_check(tmp_path: Path) -> None:
    """Checkpoints written before manifests existed are accepted (verify returns False)
    after a structural check that still catches truncation and garbage JSON."""
    ckpt = save_checkpoint(
        tmp_path, 1, state={}, tensors={"x": torch.arange(4.0)}, write_models=_worker_files
    )
    (ckpt / MANIFEST).unlink()
    assert verify_checkpoint(ckpt) is False
    weights = ckpt / "actor" / "rank00000" / "state.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(CheckpointDamaged, match="its header describes") as info:
        verify_checkpoint(ckpt)
    assert info.value.file == weights
    weights.unlink()
    (ckpt / "actor" / "rank00000" / "state.json").write_text("{")
    with pytest.raises(CheckpointDamaged, match="not readable JSON"):
        verify_checkpoint(ckpt)


def test_moved_aside_checkpoint_is_ignored(tmp_path: Path) -> None:
    """The documented way past a damaged checkpoint: move it aside (or delete it); a
    renamed directory such as ``step_000002.damaged`` is neither chosen nor pruned."""
    for step in (1, 2):
        save_checkpoint(tmp_path, step, state={}, tensors={}, write_models=_models, keep=5)
    (tmp_path / "step_000002").rename(tmp_path / "step_000002.damaged")
    assert find_latest(tmp_path) == tmp_path / "step_000001"  # `latest` names a missing one
    (tmp_path / "latest").write_bytes(b"\xff\xfe")  # even an unreadable pointer
    assert find_latest(tmp_path) == tmp_path / "step_000001"
    save_checkpoint(tmp_path, 2, state={}, tensors={}, write_models=_models, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000002.damaged"]


def test_resume_compares_what_input_paths_point_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by a user: --resume compared the paths as strings, refusing the same files
    # written another way and accepting other files behind the same relative path.
    for name, prompt in (("a", "x"), ("b", "y")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n")
        (tmp_path / name / "model").mkdir()
        (tmp_path / name / "model" / "config.json").write_text('{"model_type": "qwen2"}')
        (tmp_path / name / "model" / "w.safetensors").write_bytes(bytes(range(256)) * 64)
    relative = ["rollout.dataset_path=train.jsonl", "policy.model_path=model"]
    monkeypatch.chdir(tmp_path / "a")
    cfg, _ = load_config(None, relative, check=False)
    saved, saved_inputs = cfg.to_dict(), resume_inputs(cfg)

    def changes(now: DriverConfig) -> list[str]:
        return resume_config_changes(
            saved, now.to_dict(), saved_inputs=saved_inputs, inputs=resume_inputs(now)
        )

    absolute, _ = load_config(
        None,
        [
            f"rollout.dataset_path={tmp_path / 'b' / '..' / 'a' / 'train.jsonl'}",
            f"policy.model_path={tmp_path / 'a' / 'model'}",
        ],
        check=False,
    )
    assert changes(absolute) == []  # the same files
    assert resume_config_changes(saved, absolute.to_dict())  # strings: an older checkpoint

    monkeypatch.chdir(tmp_path / "b")  # other files behind the same strings
    (tmp_path / "b" / "model" / "w.safetensors").write_bytes(bytes(range(256)) * 64)
    found = changes(cfg)
    assert len(found) == 1 and found[0].startswith("rollout.dataset_path: "), found
    assert "not the same input" in found[0] and str(tmp_path / "b") in found[0]
    # the model directories are equal so far; then its config differs
    (tmp_path / "b" / "model" / "config.json").write_text('{"model_type": "llama"}')
    assert [c.split(":")[0] for c in changes(cfg)] == [
        "rollout.dataset_path",
        "policy.model_path",
        "critic.model_path",  # the critic is built from the policy's directory
    ]
    # the weights: their size and ends are part of the fingerprint
    (tmp_path / "b" / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "b" / "model" / "w.safetensors").write_bytes(bytes(16384))
    assert "policy.model_path" in " ".join(changes(cfg))


def test_a_failed_write_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    """A real failure (here: the disk is full while a worker writes its files) removes
    the side directory and frees its space; the previous checkpoint stays the latest.
    Only a simulated crash (the crash hook) leaves it, as a killed process would."""
    import errno

    tensors = {"x": torch.arange(4.0)}
    first = save_checkpoint(tmp_path, 1, state={}, tensors=tensors, write_models=_models)

    def full_disk(tmp: Path) -> None:
        _models(tmp)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "actor"))

    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 2, state={}, tensors=tensors, write_models=full_disk)
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("latest.tmp*"))
    assert find_latest(tmp_path) == first


# ------------------------------------------- rules a mutation sweep found untested


def test_structural_check_refuses_bytes_after_the_last_tensor(tmp_path: Path) -> None:
    ckpt = save_checkpoint(
        tmp_path, 1, state={}, tensors={"x": torch.arange(4.0)}, write_models=_worker_files
    )
    (ckpt / MANIFEST).unlink()
    tensors = ckpt / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes() + b"\0\0\0\0")
    with pytest.raises(CheckpointDamaged, match="its header describes") as info:
        verify_checkpoint(ckpt)
    assert info.value.file == tensors


def test_a_manifest_that_does_not_list_driver_json_is_refused(tmp_path: Path) -> None:
    ckpt = save_checkpoint(
        tmp_path, 1, state={}, tensors={"x": torch.arange(4.0)}, write_models=_worker_files
    )
    (ckpt / MANIFEST).write_text(json.dumps({"format": 1, "files": {}}))
    with pytest.raises(CheckpointDamaged, match=r"without driver\.json"):
        verify_checkpoint(ckpt)


def test_the_input_fingerprint_reads_the_end_of_large_weights(tmp_path: Path) -> None:
    """A model directory is fingerprinted by its small files and the first and last
    4 MiB of each weights file (and its size): in a 9 MiB file, a byte changed near
    the end is seen, and so is one near the start."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    weights = model / "model.safetensors"
    data = bytearray(random.Random(0).randbytes(9 << 20))
    weights.write_bytes(bytes(data))
    before = input_fingerprint(model)
    data[-10] ^= 0xFF  # in the last 4 MiB
    weights.write_bytes(bytes(data))
    assert input_fingerprint(model) != before
    data[-10] ^= 0xFF
    data[10] ^= 0xFF  # in the first 4 MiB
    weights.write_bytes(bytes(data))
    assert input_fingerprint(model) != before


def test_resume_from_a_damaged_checkpoint_names_the_newest_older_one_that_verifies(
    tmp_path: Path,
) -> None:
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path,
            step,
            state={},
            tensors={"x": torch.arange(4.0)},
            write_models=_worker_files,
            keep=3,
        )
    (tmp_path / "step_000003" / "driver.json").write_text("{")
    with pytest.raises(StartupError, match=r"step_000002 \(2 step\(s\) done\)"):
        _checkpoint_to_resume(tmp_path)


def test_the_task_options_cannot_change_on_resume() -> None:
    """``rollout.extra`` shapes the built-in task's prompts: a resumed run keeps it."""
    changes = resume_config_changes(
        {"rollout": {"extra": {"max_count": 8}}}, {"rollout": {"extra": {"max_count": 5}}}
    )
    assert [c.split(":")[0] for c in changes] == ["rollout.extra"]
