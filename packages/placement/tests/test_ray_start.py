"""start_local_ray: argument checks, and real start-up failures (no successful start here
except the retry test; the running cluster is tested in test_local_cluster.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import ray
from ppo_placement import RayStartError, shutdown_local_ray, start_local_ray


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"num_gpus": -1}, "num_gpus=-1", id="negative-gpus"),
        pytest.param({"num_cpus": 0}, "num_cpus=0", id="zero-cpus"),
        pytest.param({"attempts": 0}, "attempts=0", id="zero-attempts"),
        pytest.param({"nodes": 0}, "nodes=0", id="zero-nodes"),
        pytest.param({"worker_niceness": -1}, "worker_niceness=-1", id="negative-niceness"),
        pytest.param({"worker_niceness": 20}, "worker_niceness=20 .* 0 to 19", id="niceness-20"),
        pytest.param({"worker_niceness": True}, "worker_niceness=True", id="bool-niceness"),
    ],
)
def test_bad_arguments_raise_before_starting_anything(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        start_local_ray(**kwargs)
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
        # attempt 1 is made to fail; on a loaded machine attempt 2 may fail on its own.
        info = start_local_ray(num_gpus=1, attempts=3, log_to_driver=False, warm_imports=False)
        assert info.started and info.attempts >= 2
        assert ray.cluster_resources()["GPU"] == 1.0
    finally:
        shutdown_local_ray()
    assert "Timed out waiting for file" in caplog.text


def test_the_edges_of_each_argument_are_accepted() -> None:
    from ppo_placement._ray_start import _check_start_args

    _check_start_args(num_cpus=1, num_gpus=0, attempts=1, nodes=1, worker_niceness=19)
    _check_start_args(num_cpus=None, num_gpus=0, attempts=1, nodes=1, worker_niceness=0)
    _check_start_args(num_cpus=None, num_gpus=0, attempts=1, nodes=1, worker_niceness=None)


def test_node_arguments() -> None:
    from ppo_placement._ray_start import _node_args

    cores = os.cpu_count() or 1
    # no num_cpus: the core count, but one CPU per GPU at least (a {"GPU": 1, "CPU": 1}
    # bundle per GPU must fit)
    assert _node_args(None, 0, None, None)["num_cpus"] == cores
    assert _node_args(None, cores + 3, None, None)["num_cpus"] == cores + 3
    args = _node_args(2, 1, {"accelerator_x": 1.0}, 1 << 28)
    assert args == {
        "num_cpus": 2,
        "num_gpus": 1,
        "resources": {"accelerator_x": 1.0},
        "object_store_memory": 1 << 28,
        "include_dashboard": False,
    }
    assert _node_args(2, 1, {}, None)["resources"] is None


def test_worker_env_asks_nothing_of_a_ray_that_is_not_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What start_local_ray recorded outlives a ``ray.shutdown()`` made without
    shutdown_local_ray(); with Ray down there is no cluster to describe, and asking
    Ray for its session would start a new local instance."""
    from ppo_placement import _ray_start, local_worker_env

    assert not ray.is_initialized()
    monkeypatch.setattr(_ray_start, "_started_env", ("session_gone", {"A": "1"}))
    try:
        assert local_worker_env() == {}
        assert not ray.is_initialized()
    finally:
        shutdown_local_ray()
