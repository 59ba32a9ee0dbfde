"""One real local Ray cluster (4 logical GPUs, started once for the module):
start_local_ray's promises, then SharedPlacement on one node."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from ppo_placement import (
    LocalRay,
    SharedPlacement,
    local_worker_env,
    placement_layout,
    shutdown_local_ray,
    start_local_ray,
)
from ppo_placement import _placement as placement_module
from ppo_placement import _ray_start as ray_start_module
from ppo_placement._ray_processes import _descendants_started_after
from ray.util import placement_group_table

Where = Callable[..., list[dict[str, Any]]]
# What every process of the module's cluster starts with (start_local_ray's worker_env).
WORKER_ENV = {"PPO_PLACEMENT_TEST_ENV": "worker", "PPO_PLACEMENT_TEST_SHADOWED": "worker"}
# How much lower than this process the module's workers run (the default, 0, is checked
# on the two-node cluster of test_placement_two_nodes.py).
WORKER_NICENESS = 3


@pytest.fixture(scope="module")
def local_ray() -> Iterator[LocalRay]:
    shutdown_local_ray()
    os.environ["PPO_PLACEMENT_TEST_SHADOWED"] = "driver"
    try:
        info = start_local_ray(
            num_cpus=4,
            num_gpus=4,
            log_to_driver=False,
            worker_env=WORKER_ENV,
            worker_niceness=WORKER_NICENESS,
        )
    finally:
        shadowed = os.environ.pop("PPO_PLACEMENT_TEST_SHADOWED")
    # the driver's own environment is as it was: the variable it had kept its value,
    # the one it had not is not set
    assert shadowed == "driver" and "PPO_PLACEMENT_TEST_ENV" not in os.environ
    try:
        yield info
    finally:
        shutdown_local_ray()


# --- start_local_ray ------------------------------------------------------------


def test_starts_a_loopback_cluster_with_logical_gpus(local_ray: LocalRay) -> None:
    assert local_ray.started and local_ray.attempts >= 1
    assert local_ray.node_ip == "127.0.0.1"
    assert local_ray.address.startswith("127.0.0.1:")
    assert os.path.isdir(local_ray.session_dir)
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    # Under `uv run` Ray must not wrap the workers in a uv / working_dir runtime env.
    assert not ray.get_runtime_context().runtime_env
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    assert node["NodeManagerAddress"] == "127.0.0.1"
    assert ray.cluster_resources()["GPU"] == 4.0

    @ray.remote(num_gpus=1, num_cpus=0)
    def where() -> tuple[str, list[int]]:
        return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]

    ip, gpus = ray.get(where.remote(), timeout=120)
    assert ip == "127.0.0.1"
    assert len(gpus) == 1 and gpus[0] in (0, 1, 2, 3)
    # idle_workers=False: the workers Ray started (as the driver connected, and for the
    # task) exit once idle for a second; Ray's default keeps them for later tasks
    assert _workers_left_after(15.0) == [], "idle workers stayed"


def _python_workers() -> list[str]:
    """The command lines of the Ray worker processes under this one (a worker starts as
    ``python .../default_worker.py``, then names itself ``ray::IDLE`` or after its
    task); the raylet's ``ray::...Agent`` helpers are not workers."""
    found = []
    for pid in _descendants_started_after(os.getpid(), 0.0):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        starting = len(args) > 1 and args[1].endswith("default_worker.py")
        named = args[0].startswith("ray::") and "Agent" not in args[0]
        if starting or named:
            found.append(" ".join(args))
    return found


def _workers_left_after(seconds: float) -> list[str]:
    """Poll :func:`_python_workers` until none is left, for up to ``seconds``; what is left."""
    deadline = time.monotonic() + seconds
    while (found := _python_workers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_second_start_reuses_the_running_cluster(local_ray: LocalRay) -> None:
    again = start_local_ray(num_gpus=1, worker_env={"PPO_PLACEMENT_TEST_ENV": "ignored"})
    assert not again.started and again.attempts == 0
    assert again.address == local_ray.address
    assert again.session_dir == local_ray.session_dir
    # what the running cluster was started with, not what the second call asked for
    assert again.worker_env == local_ray.worker_env == WORKER_ENV == local_worker_env()


def test_worker_env_of_another_session_is_not_this_clusters(
    local_ray: LocalRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what start_local_ray recorded for a cluster since replaced (ray.shutdown() and a
    # ray.init elsewhere) does not describe the one this process is connected to
    monkeypatch.setattr(ray_start_module, "_started_env", ("session_gone", {"A": "1"}))
    assert local_worker_env() == {}


def _in_a_task_then_an_actor(probe: Callable[[], object]) -> list[object]:
    """``probe()`` run in a Ray task, then in a Ray actor created after it (each in a
    worker process of the module's cluster)."""
    task = ray.remote(num_cpus=0)(probe)
    in_task = ray.get(task.remote(), timeout=120)

    @ray.remote(num_cpus=0)
    class Probe:
        def run(self) -> object:
            return probe()

    actor = Probe.remote()  # type: ignore[attr-defined]
    try:
        return [in_task, ray.get(actor.run.remote(), timeout=120)]
    finally:
        ray.kill(actor)


def test_workers_start_with_the_worker_env(local_ray: LocalRay) -> None:
    names = sorted(WORKER_ENV)
    expected = [WORKER_ENV[k] for k in names]
    seen = _in_a_task_then_an_actor(lambda: [os.environ.get(k) for k in names])
    assert seen == [expected, expected]


def test_workers_run_worker_niceness_below_this_process(local_ray: LocalRay) -> None:
    expected = min(os.nice(0) + WORKER_NICENESS, 19)
    assert _in_a_task_then_an_actor(lambda: os.nice(0)) == [expected, expected]


def test_reuse_refuses_a_cluster_with_too_few_gpus(local_ray: LocalRay) -> None:
    with pytest.raises(ValueError, match=r"num_gpus=5, nodes=1: .* 1 node\(s\) of 4 GPU"):
        start_local_ray(num_gpus=5)
    assert ray.is_initialized()


# --- SharedPlacement on one node ---------------------------------------------------


def test_separate_rollout_actor_critic_share_bundles(local_ray: LocalRay, where: Where) -> None:
    layout = placement_layout(actor_gpus=2, rollout_gpus=1)
    with SharedPlacement(layout) as placement:
        bundles = placement.bundles
        assert [b.index for b in bundles] == [0, 1, 2]
        assert {b.node_ip for b in bundles} == {"127.0.0.1"}
        gpu_ids = [b.gpu_id for b in bundles]
        assert gpu_ids == sorted(gpu_ids) and len(set(gpu_ids)) == 3
        actor, critic, rollout = (
            placement.actor_view(),
            placement.critic_view(),
            placement.rollout_view(),
        )
        assert len(actor) == len(critic) == 2 and len(rollout) == 1
        for a, c in zip(actor, critic, strict=True):
            assert (a.rank, a.bundle_index, a.gpu_id) == (c.rank, c.bundle_index, c.gpu_id)
            assert a.num_gpus + c.num_gpus <= 1.0
        assert rollout[0].bundle == bundles[2]
        assert not {s.bundle_index for s in rollout} & {s.bundle_index for s in actor}
        assert actor.node_boundaries == (range(0, 2),)
        assert [s.local_rank for s in actor] == [0, 1]

        # Actor and critic ranks alive on their shared GPUs at the same time.
        slots = [*actor, *critic, *rollout]
        reports = where(slots)
        for slot, report in zip(slots, reports, strict=True):
            assert report["gpu_ids"] == [slot.gpu_id], slot
            assert report["node_id"] == slot.node_id
            assert report["node_ip"] == "127.0.0.1"


def test_colocated_rollout_shares_the_training_bundles(local_ray: LocalRay, where: Where) -> None:
    layout = placement_layout(actor_gpus=2, rollout_gpus=1, colocate=True)
    assert layout.num_gpus == 2
    with SharedPlacement(layout) as placement:
        actor, critic, rollout = (
            placement.actor_view(),
            placement.critic_view(),
            placement.rollout_view(),
        )
        assert [s.bundle for s in rollout] == [actor[0].bundle]
        assert actor[0].num_gpus + critic[0].num_gpus + rollout[0].num_gpus <= 1.0
        # All three roles on bundle 0 at once: the fractional requests fit together.
        slots = [actor[0], critic[0], rollout[0]]
        reports = where(slots)
        assert [r["gpu_ids"] for r in reports] == [[actor[0].gpu_id]] * 3


def test_create_and_teardown_are_idempotent(local_ray: LocalRay) -> None:
    placement = SharedPlacement(placement_layout(actor_gpus=4, rollout_gpus=0, train_only=True))
    with pytest.raises(RuntimeError, match=r"call create\(\)"):
        placement.actor_view()
    placement.create()
    pg = placement.placement_group
    first = placement.bundles
    assert placement.create() is placement  # second create: no-op
    assert placement.placement_group is pg and placement.bundles == first
    assert [b.gpu_id for b in first] == [0, 1, 2, 3]
    placement.teardown()
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert not placement.created and placement.placement_group is None
    placement.teardown()  # second teardown: no-op
    # The GPUs are free again: a new group of all 4 can be created.
    placement.create()
    assert len(placement.bundles) == 4
    placement.teardown()


def _no_probe() -> tuple[str, str, list[str]]:
    raise AssertionError("a probe task ran")


@pytest.mark.parametrize(
    ("kwargs", "gpu_ids"),
    [
        ({"probe_gpu_ids": False}, [None, None, None]),  # logical GPUs naming no device
        ({"bundle_resources": {"CPU": 1.0}}, [None, None, None]),  # no GPUs in the bundles
    ],
)
def test_bundles_are_found_without_a_probe_task_where_no_gpu_id_is_needed(
    local_ray: LocalRay,
    where: Where,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    gpu_ids: list[int | None],
) -> None:
    # A probe task would run _no_probe, and fail in the worker (the message names the task).
    monkeypatch.setattr(placement_module, "_probe", _no_probe)
    layout = placement_layout(actor_gpus=2, rollout_gpus=1)
    with SharedPlacement(layout, **kwargs) as placement:
        bundles = placement.bundles
        (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert [b.gpu_id for b in bundles] == gpu_ids
        assert {(b.node_id, b.node_ip) for b in bundles} == {(node, "127.0.0.1")}
        assert [b.bundle_index for b in bundles] == [0, 1, 2]  # Ray's order on one node
        slots = [*placement.actor_view(), *placement.critic_view()]
        for slot, report in zip(slots, where(slots), strict=True):
            assert report["node_id"] == slot.node_id
    # the same bundles with the probe (the default) do run it
    if "probe_gpu_ids" in kwargs:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"ppo_placement\.probe\[\d\]"):
            SharedPlacement(layout).create()


def test_nothing_local_reserves_nothing(local_ray: LocalRay) -> None:
    layout = placement_layout(
        actor_gpus=0, rollout_gpus=0, rollout_external=True, rollout_only=True
    )
    with SharedPlacement(layout) as placement:
        assert placement.placement_group is None
        assert placement.bundles == ()
        assert len(placement.actor_view()) == len(placement.rollout_view()) == 0


def test_too_many_bundles_time_out_and_release(local_ray: LocalRay) -> None:
    placement = SharedPlacement(placement_layout(actor_gpus=4, rollout_gpus=2), ready_timeout_s=3)
    with pytest.raises(TimeoutError, match=r"6 x \{'GPU': 1.0, 'CPU': 1.0\}"):
        placement.create()
    assert not placement.created
    assert ray.available_resources().get("GPU", 0.0) == 4.0


@pytest.fixture
def where(where_actors_run: Where) -> Where:
    return where_actors_run


# --- last: stop the shared cluster ---------------------------------------------------


def test_shutdown_is_idempotent(local_ray: LocalRay) -> None:
    # Runs last in this module: stops the shared cluster, then stops nothing.
    shutdown_local_ray()
    assert not ray.is_initialized()
    shutdown_local_ray()
    assert not ray.is_initialized()
