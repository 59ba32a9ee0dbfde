"""What ``ppo-driver train`` refuses before anything starts, and the workers' refusal of a
non-finite update (issue 11, section 4). No Ray here: every refusal below must come
before Ray starts, which the tests check (``ray`` is never initialised).

The signal, lock-while-running and damaged-real-checkpoint drills run the real command
line in ``test_driver_cli_safety_signals.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from driver_testlib import TINY_RUN
from ppo_driver import run as run_module
from ppo_driver._rundir import _claim_contents
from ppo_driver._signals import _Interrupt, _SignalGuard
from ppo_driver.checkpoint import save_checkpoint
from ppo_driver.cli import _parse, main
from ppo_driver.config import default_config_path, load_config
from ppo_driver.run import FAIL_POINTS, RunLock, StartupError
from ppo_trainer import ActorConfig, ActorWorker, CriticConfig, CriticWorker, ModelSpec

SPEC = ModelSpec(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    seed=7,
)


def _ray_started() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``ppo-driver train ARGV`` in this process: (exit code, stderr)."""
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert not _ray_started(), "the refusal came after Ray started"
    assert "Traceback" not in err
    return code, err


# ------------------------------------------------------------------ non-finite update


def _batch(rows: int = 4, width: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(rows, width)
    mask[:, 3:] = 1.0
    return {
        "input_ids": torch.randint(1, SPEC.vocab_size, (rows, width), generator=g),
        "attention_mask": torch.ones(rows, width, dtype=torch.long),
        "loss_mask": mask,
    }


def _weights(worker: ActorWorker | CriticWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.export_weights().items()}


def test_workers_refuse_a_huge_reward_before_any_optimizer_step() -> None:
    """A reward of 1e30 gives returns/advantages of 1e30: the critic's value loss is inf
    and the actor's gradient norm overflows. Before: the critic's loss was dropped from
    the metrics and the actor's update silently clipped to nothing; now both refuse,
    naming the quantity, and nothing is updated (weights and step counters unchanged)."""
    torch.set_num_threads(1)
    batch = _batch()
    huge = torch.full(batch["loss_mask"].shape, 1e30) * batch["loss_mask"]

    critic = CriticWorker(CriticConfig(model=SPEC, device="cpu", lr=1e-2, micro_batch_size=2))
    before = _weights(critic)
    with pytest.raises(FloatingPointError, match=r"loss/value = inf is not finite.*no optimizer"):
        critic.train(
            batch,
            returns=huge,
            old_values=torch.zeros_like(huge),
            epochs=2,
            mini_batch_size=4,
        )
    assert critic.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in critic.export_weights().items())

    actor = ActorWorker(
        ActorConfig(model=SPEC, device="cpu", lr=1e-2, micro_batch_size=2, loss_agg="sample")
    )
    before = _weights(actor)
    actor.train_chunk(batch, advantages=huge, loss_denominator=4.0)
    with pytest.raises(FloatingPointError, match=r"actor/grad_norm = inf is not finite"):
        actor.finish_step()
    assert actor.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in actor.export_weights().items())
    assert all(float(g.abs().sum()) == 0.0 for g in actor.grads().values())  # discarded


# ------------------------------------------------------------------ run directory


def test_used_run_dir_is_refused_without_resume_or_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a fresh run into a used directory ran, and checkpoint pruning (highest
    step numbers kept) deleted the new run's own checkpoints."""
    run_dir = tmp_path / "used"
    (run_dir / "checkpoints" / "step_000009").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    code, err = _train(capsys, "--run-dir", str(run_dir), "--no-progress", *TINY_RUN)
    assert code == 1
    assert str(run_dir) in err and "--resume" in err and "--overwrite" in err
    assert "checkpoints, metrics.jsonl" in err
    assert (run_dir / "checkpoints" / "step_000009").is_dir()  # nothing touched
    unrelated = tmp_path / "home"
    (unrelated / "notes").mkdir(parents=True)
    code, err = _train(capsys, "--run-dir", str(unrelated), "--overwrite", *TINY_RUN)
    assert code == 1 and "does not look like a ppo-driver run directory" in err
    assert (unrelated / "notes").is_dir()  # --overwrite only empties a run directory
    with pytest.raises(SystemExit):  # the two exclude each other
        main(["train", "--run-dir", str(run_dir), "--resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_run_dir_left_by_a_failed_start_up_is_reused(tmp_path: Path) -> None:
    """A start-up that failed (Ray, a model file) leaves its config and log but no step:
    the retry needs no --overwrite, and the failed attempt's log is kept."""
    run_dir = tmp_path / "failed"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {}\n")
    (run_dir / "train.log").write_text("start-up failed\n")
    (run_dir / "checkpoints").mkdir()
    assert _claim_contents(run_dir, resume=False, overwrite=False) == []
    assert (run_dir / "train.log").read_text() == "start-up failed\n"
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # a finished step: refused
    with pytest.raises(StartupError, match="is not empty"):
        _claim_contents(run_dir, resume=False, overwrite=False)


def test_run_dir_held_by_another_run_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = RunLock.acquire(tmp_path)  # this process plays the running run
    try:
        code, err = _train(capsys, "--run-dir", str(tmp_path), "--resume", *TINY_RUN)
    finally:
        lock.release()
    assert code == 1
    assert "in use by another run" in err
    assert f"pid {os.getpid()} on {socket.gethostname()}, started " in err
    again = RunLock.acquire(tmp_path)  # released: the next run gets it
    again.release()


def test_unusable_run_dir_is_refused_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a raw FileNotFoundError / PermissionError traceback."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for run_dir, says in (
        (a_file, "is a file, not a directory"),
        (a_file / "run", "cannot be used: Not a directory"),
    ):
        code, err = _train(capsys, "--run-dir", str(run_dir), *TINY_RUN)
        assert code == 1
        assert str(run_dir) in err and says in err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "read_only"
        locked.mkdir(mode=0o500)
        code, err = _train(capsys, "--run-dir", str(locked / "run"), *TINY_RUN)
        assert code == 1 and "Permission denied" in err


def test_a_stop_signal_waits_for_the_checkpoint_being_written() -> None:
    """A real SIGTERM while a checkpoint is written: the checkpoint completes, then the
    run stops; a second signal while stopping does not interrupt the teardown."""
    previous = signal.getsignal(signal.SIGTERM)
    guard = _SignalGuard()
    guard.install()
    written: list[str] = []
    try:
        with pytest.raises(_Interrupt), guard.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs here: recorded, not raised
            written.append("checkpoint")
        assert written == ["checkpoint"] and guard.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # while stopping: logged only
        time.sleep(0.1)
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGTERM) == previous


# ------------------------------------------------------------------ flags and environment


def test_fail_at_typo_is_refused_by_train_and_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an unknown point was silently never reached (no drill, exit 0)."""
    monkeypatch.setenv("PPO_DRIVER_FAIL_AT", "1:befor_critic")
    code, err = _train(capsys, "--run-dir", str(tmp_path / "run"), *TINY_RUN)
    assert code == 1
    assert "PPO_DRIVER_FAIL_AT='1:befor_critic'" in err
    assert all(point in err for point in FAIL_POINTS)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    assert main(["validate", *TINY_RUN]) == 1
    assert "befor_critic" in capsys.readouterr().err


def test_overrides_may_come_before_between_and_after_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: argparse rejected overrides split around flags."""
    _, args = _parse(
        ["train", "run.num_steps=3", "--no-progress", "ppo.eps_clip=0.3", "--run-dir", "d", "x=1"]
    )
    assert args.overrides == ["run.num_steps=3", "ppo.eps_clip=0.3", "x=1"]
    assert args.no_progress and args.run_dir == Path("d") and args.command == "train"
    config = str(default_config_path())
    assert main(["validate", "run.num_steps=3", "--config", config, "ppo.eps_clip=0.3"]) == 0
    assert "config OK" in capsys.readouterr().out


# ------------------------------------------------------------------ resume checks


def _fake_run(run_dir: Path, overrides: list[str], steps: int) -> None:
    """Checkpoints 1..steps as ``save_checkpoint`` writes them (dummy model files)."""
    cfg, _ = load_config(None, overrides, check=False)

    def models(tmp: Path) -> None:
        for role in ("actor", "critic"):
            (tmp / role / "rank00000").mkdir(parents=True)
            (tmp / role / "rank00000" / "state.json").write_text('{"format": 1}')

    for step in range(1, steps + 1):
        save_checkpoint(
            run_dir / "checkpoints",
            step,
            state={"completed_steps": step, "config": cfg.to_dict()},
            tensors={"x": torch.arange(3.0)},
            write_models=models,
            keep=5,
        )


def test_resume_refuses_a_changed_state_shaping_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``--resume ppo.num_prompts_per_step=16`` was accepted without a word."""
    _fake_run(tmp_path, TINY_RUN, steps=1)
    code, err = _train(
        capsys,
        "--run-dir",
        str(tmp_path),
        "--resume",
        *TINY_RUN,
        "ppo.num_prompts_per_step=16",
        "run.seed=3",
        "policy.hidden_size=64",
        "run.num_steps=7",  # may change
    )
    assert code == 1
    assert "ppo.num_prompts_per_step: 8 (saved) -> 16" in err
    assert "run.seed: 0 (saved) -> 3" in err
    assert "policy.hidden_size: 32 (saved) -> 64" in err
    assert "3 key(s) differ" in err and "num_steps" not in err


def test_resume_with_nothing_left_to_train_says_so_without_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: Ray started and both models were built (25 s), then the run ended
    without a word."""
    _fake_run(tmp_path, TINY_RUN, steps=2)
    monkeypatch.setattr(run_module, "_run", None)  # calling it would be the bug
    code, err = _train(capsys, "--run-dir", str(tmp_path), "--resume", *TINY_RUN, "run.num_steps=2")
    assert code == 0
    assert "2 step(s) done, run.num_steps=2: nothing to train" in err
    assert "raise run.num_steps" in err


def test_resume_refuses_a_damaged_checkpoint_naming_file_and_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a SafetensorError / JSONDecodeError naming no file, after Ray started."""
    _fake_run(tmp_path, TINY_RUN, steps=2)
    newest = tmp_path / "checkpoints" / "step_000002"
    tensors = newest / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-5])
    code, err = _train(capsys, "--run-dir", str(tmp_path), "--resume", *TINY_RUN)
    assert code == 1
    assert f"{tensors}: " in err and "the manifest says" in err
    assert "step_000001 (1 step(s) done)" in err and "move step_000002 out of" in err

    _fake_run(tmp_path, TINY_RUN, steps=2)  # intact again; now garbage in the JSON state
    state = newest / "driver.json"
    state.write_bytes(b"#" * state.stat().st_size)  # garbage of the same length
    (tmp_path / "checkpoints" / "step_000001" / "actor" / "rank00000" / "state.json").write_text(
        "?"
    )
    code, err = _train(capsys, "--run-dir", str(tmp_path), "--resume", *TINY_RUN)
    assert code == 1
    assert f"{state}: contents differ from the manifest (sha256)" in err
    assert "No older complete checkpoint verifies" in err and "--overwrite" in err


def test_a_reward_that_keeps_failing_stops_the_cli_with_its_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RewardFailure`` (raised by the rollout manager after N failed groups in a row, see
    ``test_engine_ray.py``) reaches the user as a message with the first traceback, exit 1."""
    import ppo_driver.run
    from ppo_driver.rollout import RewardFailure

    def failing_train(*args: object, **kwargs: object) -> None:
        raise RewardFailure("32 groups failed in a row; first failure: ValueError: Boom")

    monkeypatch.setattr(ppo_driver.run, "train", failing_train)
    code, err = _train(capsys, "--run-dir", str(tmp_path / "run"), *TINY_RUN)
    assert code == 1
    assert "stopped: 32 groups failed in a row" in err and "Boom" in err
    assert "checkpoint" in err  # says what was last checkpointed (here: nothing)
