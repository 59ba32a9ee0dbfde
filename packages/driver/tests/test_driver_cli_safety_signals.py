"""A hostile-but-fair run of the real ``ppo-driver train`` command line (issue 11, section 4).

Three process starts (each launches Ray, the slow part here), each in its own session so
that what it leaves behind can be found by process group:

A. ``--overwrite`` into a used run directory, overrides before, between and after the
   flags; while it trains, a second run into the same directory is refused naming the
   holder; then SIGTERM to the process: exit 143, a message naming the last checkpoint
   and how to resume, nothing left running, none of the old run's files left.
B. SIGINT to the whole process group (what Ctrl-C does) in step 2: exit 130, the same
   guarantees; then, on its real checkpoints and before Ray would start, ``--resume``
   refuses a changed ``ppo.num_prompts_per_step``, a truncated worker
   ``state.safetensors`` and garbage in ``driver.json``, naming the file and the older
   checkpoint to use instead.
C. A reward function returning 1e30: the run stops at step 0 naming the non-finite
   quantity, exit 1, no step recorded, no checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from driver_testlib import TINY_RUN
from ppo_driver.checkpoint import verify_checkpoint
from ppo_driver.cli import main
from ppo_driver.run import RunLock

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

WAIT_S = 900  # Ray start-up plus a few tiny steps on a loaded 2-core machine
OVERRIDES = ["run.num_steps=6", *TINY_RUN, "rollout.max_new_tokens=8"]


class Run:
    """``ppo-driver train`` in a new session (its own process group); stderr collected."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "ppo_driver.cli", "train", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never logged {text!r}:\n{self.stderr[-4000:]}")
            time.sleep(0.2)

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not exit:\n{self.stderr[-4000:]}")
        self._reader.join(timeout=30)
        return code

    def leftovers(self, *, grace_s: float = 60.0) -> str:
        """What still runs in the run's process group after ``grace_s`` ('' if nothing)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return ""
            time.sleep(0.5)
        listing = subprocess.run(
            ["ps", "-o", "pid,args", "-g", str(self.proc.pid)], capture_output=True, text=True
        ).stdout
        self.kill()
        return listing

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _latest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def _assert_clean_stop(run: Run, code: int, run_dir: Path, *, signame: str, want: int) -> None:
    err = run.stderr
    assert code == want, err[-4000:]
    assert (
        f"ppo-driver: stopped by {signame}; the workers, the engines and Ray are shut down" in err
    )
    latest = _latest(run_dir)
    step = int(latest.name.split("_")[1])
    assert f"last complete checkpoint: {latest} ({step} step(s) done)" in err
    assert f"to continue: ppo-driver train --run-dir {run_dir} --resume" in err
    assert "Traceback" not in err and "SIGABRT" not in err, err[-4000:]
    assert run.leftovers() == ""
    assert not list((run_dir / "checkpoints").glob("*.partial"))  # nothing half-written
    assert verify_checkpoint(latest)
    RunLock.acquire(run_dir).release()  # the lock went with the process


def test_sigterm_overwrite_and_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    old = run_dir / "checkpoints" / "step_000009"  # an earlier run's files
    old.mkdir(parents=True)
    (old / "driver.json").write_text("{}")
    (run_dir / "checkpoints" / "latest").write_text(old.name)
    (run_dir / "metrics.jsonl").write_text('{"step": 8}\n')

    head, tail = OVERRIDES[:2], OVERRIDES[2:]
    run = Run(
        *head, "--run-dir", str(run_dir), *tail[:3], "--no-progress", "--overwrite", *tail[3:]
    )
    try:
        run.wait_for("train_pump: step 0 chunk 1")
        assert main(["train", "--run-dir", str(run_dir), "--resume", *OVERRIDES]) == 1
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {run.proc.pid} on " in err, err
        run.wait_for("train_pump: step 1 chunk 1")  # checkpoint 1 written
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish()
    finally:
        run.kill()
    _assert_clean_stop(run, code, run_dir, signame="SIGTERM", want=143)
    assert not old.exists()  # --overwrite cleared the old run; its pruning kept ours
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert '"step": 8' not in "".join(rows) and len(rows) >= 1


def test_sigint_then_resume_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run = Run("--run-dir", str(run_dir), "--no-progress", *OVERRIDES)
    try:
        run.wait_for("train_pump: step 2 chunk 1")  # checkpoints 1 and 2 written
        os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        code = run.finish()
    finally:
        run.kill()
    _assert_clean_stop(run, code, run_dir, signame="SIGINT", want=130)

    def resume(*extra: str) -> str:
        started = time.monotonic()
        assert main(["train", "--run-dir", str(run_dir), "--resume", *OVERRIDES, *extra]) == 1
        assert time.monotonic() - started < 30  # refused before Ray would start
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    assert "ppo.num_prompts_per_step: 8 (saved) -> 16 (now)" in resume(
        "ppo.num_prompts_per_step=16"
    )
    latest = _latest(run_dir)
    older = f"step_{int(latest.name.split('_')[1]) - 1:06d}"
    weights = latest / "actor" / "rank00000" / "state.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])
    err = resume()
    assert f"{weights}: {len(intact) // 2} bytes, the manifest says {len(intact)}" in err
    assert f"older checkpoint that verifies is {run_dir / 'checkpoints' / older}" in err
    assert f"move {latest.name} out of {run_dir / 'checkpoints'}" in err
    weights.write_bytes(intact)
    state = latest / "driver.json"
    state.write_bytes(b"\x00garbage" + state.read_bytes()[8:])
    assert f"{state}: contents differ from the manifest (sha256)" in resume()


def test_huge_reward_stops_at_the_step_naming_the_quantity(tmp_path: Path) -> None:
    (tmp_path / "huge_reward_for_test.py").write_text(
        "def reward(*, response, record, finish_reason):\n    return 1e30\n"
    )
    run_dir = tmp_path / "run"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    run = Run(
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *OVERRIDES,
        "run.num_steps=2",
        "rollout.reward=huge_reward_for_test:reward",
        env={"PYTHONPATH": path},
    )
    try:
        code = run.finish()
    finally:
        run.kill()
    err = run.stderr
    assert code == 1, err[-4000:]
    assert "ppo-driver: stopped: step 0: " in err, err[-4000:]
    assert "is not finite; no optimizer step was taken" in err
    assert any(q in err for q in ("loss/pg =", "actor/grad_norm =", "loss/value =")), err
    assert "nothing of that step was applied or recorded; no checkpoint was written" in err
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    assert not list(run_dir.glob("checkpoints/step_*"))
    assert run.leftovers() == ""
