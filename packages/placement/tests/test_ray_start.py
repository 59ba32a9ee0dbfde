"""start_local_ray / shutdown_local_ray against a real local Ray cluster (one start here)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import ray
from ppo_placement import LocalRay, RayStartError, shutdown_local_ray, start_local_ray


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"num_gpus": -1}, "num_gpus=-1", id="negative-gpus"),
        pytest.param({"num_cpus": 0}, "num_cpus=0", id="zero-cpus"),
        pytest.param({"attempts": 0}, "attempts=0", id="zero-attempts"),
    ],
)
def test_bad_arguments_raise_before_starting_anything(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        start_local_ray(**kwargs)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[LocalRay]:
    shutdown_local_ray()
    info = start_local_ray(num_cpus=2, num_gpus=2, log_to_driver=False)
    try:
        yield info
    finally:
        shutdown_local_ray()


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
    assert ray.cluster_resources()["GPU"] == 2.0

    @ray.remote(num_gpus=1, num_cpus=0)
    def where() -> tuple[str, list[int]]:
        return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]

    ip, gpus = ray.get(where.remote(), timeout=120)
    assert ip == "127.0.0.1"
    assert len(gpus) == 1 and gpus[0] in (0, 1)


def test_second_start_reuses_the_running_cluster(local_ray: LocalRay) -> None:
    again = start_local_ray(num_gpus=1)
    assert not again.started and again.attempts == 0
    assert again.address == local_ray.address
    assert again.session_dir == local_ray.session_dir


def test_reuse_refuses_a_cluster_with_too_few_gpus(local_ray: LocalRay) -> None:
    with pytest.raises(ValueError, match=r"num_gpus=3.*only 2 GPU"):
        start_local_ray(num_gpus=3)
    assert ray.is_initialized()


def test_shutdown_is_idempotent(local_ray: LocalRay) -> None:
    # Runs last in this module: stops the shared cluster, then stops nothing.
    shutdown_local_ray()
    assert not ray.is_initialized()
    shutdown_local_ray()
    assert not ray.is_initialized()


@pytest.mark.slow
def test_failed_start_quotes_the_raylets_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    # A real raylet failure: this Ray config value makes the raylet abort at start-up
    # (a RAY_CHECK), after which Ray's Python side waits its fixed 30 s and reports the
    # uninformative "node timed out during startup". The error must quote raylet.out.
    shutdown_local_ray()
    monkeypatch.setenv("RAY_max_task_args_memory_fraction", "0")
    with pytest.raises(RayStartError) as caught:
        start_local_ray(num_gpus=1, attempts=1, log_to_driver=False)
    message = str(caught.value)
    assert "1 attempt(s)" in message
    assert "raylet.out says" in message
    assert "max_task_args_memory_fraction" in message
    assert len(caught.value.reasons) == 1
    assert not ray.is_initialized()
