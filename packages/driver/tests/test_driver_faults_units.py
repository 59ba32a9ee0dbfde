"""The parts of the lost-cluster handling (issue 26 item 2) that need no cluster: which
faults are checked against the GCS, and the watcher of an abrupt end (a real process
reading a real pipe, a real port that refuses or accepts)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ppo_driver._faults import _from_ray, _name_the_worker, describe_fault
from ppo_driver.pair import TrainPair
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import TrainGroup, WorkerLost
from ppo_lifecycle import ResidencyPlanner, Role


def _raised_from(exc: BaseException, cause: BaseException) -> BaseException:
    try:
        raise exc from cause
    except BaseException as raised:
        return raised


@pytest.mark.parametrize(
    ("exc", "want"),
    [
        pytest.param(ray.exceptions.RayActorError(), True, id="ray-actor-error"),
        pytest.param(
            _raised_from(
                WorkerLost("actor", 0, 12, "127.0.0.1", "ActorUnavailableError"),
                ray.exceptions.ActorUnavailableError("gone", None),
            ),
            True,
            id="worker-lost-from-ray",
        ),
        pytest.param(OSError(28, "No space left on device"), False, id="os-error"),
        pytest.param(
            _raised_from(RuntimeError("wrapped"), ValueError("inner")), False, id="no-ray"
        ),
    ],
)
def test_faults_checked_against_the_gcs(exc: BaseException, want: bool) -> None:
    assert _from_ray(exc) is want


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    (ckpts / "step_000002").mkdir(parents=True)
    (ckpts / "step_000002" / "driver.json").write_text("{}")
    (ckpts / "latest").write_text("step_000002")
    (ckpts / "step_000003.partial" / "actor").mkdir(parents=True)  # the lost workers'
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2))
    )
    (run_dir / "train.log").write_text("")
    return run_dir


@contextmanager
def _port(*, listening: bool) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    if listening:
        sock.listen()
    else:
        sock.close()  # nothing listens there: connections are refused
    try:
        yield port
    finally:
        sock.close()


def _watch(port: int, run_dir: Path, said: bytes) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_driver._watch", f"127.0.0.1:{port}", str(run_dir),
         f"ppo-driver train --run-dir {run_dir} --resume"],
        input=said, capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    return proc.stderr.decode()


def test_the_watcher_reports_an_end_on_a_lost_cluster(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    with _port(listening=False) as port:
        err = _watch(port, run_dir, b"")  # the driver ended without its own report
    assert (
        f"ppo-driver: stopped at step 3: the Ray cluster's head (127.0.0.1:{port}) does not answer"
        in err
    )
    assert (
        f"last complete checkpoint: {run_dir / 'checkpoints' / 'step_000002'} (2 step(s) done)"
        in err
    )
    assert f"ppo-driver: to continue: ppo-driver train --run-dir {run_dir} --resume" in err
    assert not (run_dir / "checkpoints" / "step_000003.partial").exists()
    assert "(seen by the watcher)" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize(
    ("listening", "said"),
    [
        pytest.param(False, b"done\n", id="the-cli-reported-the-end"),
        pytest.param(True, b"", id="the-cluster-answers"),
    ],
)
def test_the_watcher_says_nothing_otherwise(tmp_path: Path, listening: bool, said: bytes) -> None:
    run_dir = _run_dir(tmp_path)
    with _port(listening=listening) as port:
        assert _watch(port, run_dir, said) == ""
    assert (run_dir / "checkpoints" / "step_000003.partial").exists()
    assert (run_dir / "train.log").read_text() == ""


class _Handle:
    """What :meth:`TrainGroup.owns` reads of a Ray actor handle: its id."""

    def __init__(self, hex_id: str) -> None:
        self._actor_id = type("ActorID", (), {"hex": lambda _self: hex_id})()


def _group(role: str, ids: list[str], pids: list[int]) -> Any:
    group = object.__new__(TrainGroup)
    group.role, group.handles = role, [_Handle(i) for i in ids]
    group.processes = [(pid, "10.0.0.7") for pid in pids]
    return group


def test_a_dead_rank_seen_outside_its_group_is_named() -> None:
    """A trainer rank that dies while the refit (which calls the actor's ranks directly,
    not through ``TrainGroup.submit``) waits on it: the fault names the role, the rank and
    its process as when a group call sees it. Before: ``ActorDiedError: The actor died
    unexpectedly before finishing this task.``"""
    built = SimpleNamespace(
        actor=_group("actor", ["a0", "a1"], [101, 102]), critic=_group("critic", ["c0"], [201])
    )
    died = ray.exceptions.RayActorError(actor_id="a1", error_msg="died unexpectedly")
    named = _name_the_worker(died, built)  # type: ignore[arg-type]
    assert isinstance(named, WorkerLost)
    assert describe_fault(named).startswith(
        "WorkerLost: the actor worker (rank 1, pid 102 on 10.0.0.7) died (RayActorError)"
    )
    critic = ray.exceptions.RayActorError(actor_id="c0")
    assert "the critic worker (rank 0, pid 201 on 10.0.0.7)" in str(_name_the_worker(critic, built))  # type: ignore[arg-type]
    engine = ray.exceptions.RayActorError(actor_id="e0")  # an engine's: handled elsewhere
    assert _name_the_worker(engine, built) is engine  # type: ignore[arg-type]
    assert _name_the_worker(engine, None) is engine
    other = OSError(28, "No space left on device")
    assert _name_the_worker(other, built) is other  # type: ignore[arg-type]


def test_the_refit_names_a_dead_actor_rank_and_runs_once_the_actor_is_resident() -> None:
    """``TrainPair.refit``: the weight transfer runs once the plan has made the actor
    resident (here it already is: no transition), and a rank of the actor that dies
    while it runs comes out as the group's :class:`WorkerLost`, not Ray's error."""
    actor = _group("actor", ["a0", "a1"], [101, 102])
    pair = TrainPair(actor, _group("critic", ["c0"], [201]), trace=TraceRecorder())
    pair.planner = ResidencyPlanner(resident=Role.ACTOR)
    assert pair.refit(0, lambda: "pushed") == "pushed"

    def dies() -> None:
        raise ray.exceptions.RayActorError(actor_id="a1", error_msg="died unexpectedly")

    with pytest.raises(WorkerLost, match=r"the actor worker \(rank 1, pid 102 on 10.0.0.7\)"):
        pair.refit(0, dies)
    engine = ray.exceptions.RayActorError(actor_id="e0")  # an engine's: not the pair's

    def engine_dies() -> None:
        raise engine

    with pytest.raises(ray.exceptions.RayActorError) as info:
        pair.refit(0, engine_dies)
    assert info.value is engine
