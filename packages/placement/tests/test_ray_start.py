"""start_local_ray / shutdown_local_ray against a real local Ray cluster (one start here)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

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


# --- the failure seen on this machine, reproduced -----------------------------------
#
# A `sitecustomize` on PYTHONPATH delays the raylet's dashboard agent (the process that
# writes metrics_agent_port_*) past the raylet's fixed 30 s wait: the raylet aborts with
# "Timed out waiting for file .../metrics_agent_port_..." and Ray's Python side reports
# only "The current node timed out during startup", exactly as seen on a loaded 2-core box.

_SLOW_AGENT = """
import os, sys, time
if any(a.endswith("dashboard/agent.py") for a in sys.argv):
    marker = os.environ["PPO_TEST_SLOW_AGENT_MARKER"]
    if os.environ.get("PPO_TEST_SLOW_AGENT_ALWAYS") or not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(40)
"""


@pytest.fixture
def slow_dashboard_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutdown_local_ray()
    (tmp_path / "sitecustomize.py").write_text(_SLOW_AGENT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PPO_TEST_SLOW_AGENT_MARKER", str(tmp_path / "slowed"))
    return tmp_path


@pytest.mark.slow
def test_failed_start_quotes_the_raylets_reason(
    slow_dashboard_agent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPO_TEST_SLOW_AGENT_ALWAYS", "1")
    with pytest.raises(RayStartError) as caught:
        start_local_ray(num_gpus=1, attempts=1, log_to_driver=False, warm_imports=False)
    message = str(caught.value)
    assert "1 attempt(s)" in message
    assert "raylet.out says" in message
    assert "Timed out waiting for file" in message
    assert "metrics_agent_port_" in message
    assert len(caught.value.reasons) == 1
    assert not ray.is_initialized()
    assert (slow_dashboard_agent / "slowed").exists()


@pytest.mark.slow
def test_retry_recovers_from_a_slow_agent(
    slow_dashboard_agent: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ppo_placement")
    try:
        info = start_local_ray(num_gpus=1, attempts=2, log_to_driver=False, warm_imports=False)
        assert info.started and info.attempts == 2
        assert ray.cluster_resources()["GPU"] == 1.0
    finally:
        shutdown_local_ray()
    assert "Timed out waiting for file" in caplog.text
