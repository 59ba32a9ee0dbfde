"""``cluster.address``: validation of the key, and the start-up failure for a cluster
that is not there (fast; the two-node join runs in ``test_driver_cluster_two_nodes.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ppo_driver._engines import _refit_backend
from ppo_driver.config import load_config


def _problems(*overrides: str) -> tuple[list[str], list[str]]:
    _, report = load_config(None, list(overrides), check=False)
    return [str(p) for p in report.errors], [str(p) for p in report.warnings]


@pytest.mark.parametrize("address", ["auto", "127.0.0.1:6379", "head.example:6379", "[::1]:6379"])
def test_well_formed_addresses_validate(address: str) -> None:
    errors, warnings = _problems(f"cluster.address={address}")
    assert errors == [] and warnings == []


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "has no port"),
        ("127.0.0.1:99999", "not a number in 1..65535"),
        ("ray://head:10001", "ray:// URL"),
        ("'head node:6379'", "not a host name"),
        ("''", "is empty"),
    ],
)
def test_malformed_address_is_one_error_naming_the_key(address: str, why: str) -> None:
    errors, _ = _problems(f"cluster.address={address}")
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("error: cluster.address=") and why in error
    assert "host:port" in error and "null to start a local cluster" in error  # the fix


def test_address_with_a_number_is_a_type_error() -> None:
    errors, _ = _problems("cluster.address=6379")
    assert len(errors) == 1 and "cluster.address" in errors[0] and "expected str" in errors[0]


def test_num_cpus_is_a_warning_when_joining() -> None:
    errors, warnings = _problems("cluster.address=auto", "cluster.num_cpus=8")
    assert errors == []
    assert len(warnings) == 1 and warnings[0].startswith("warning: cluster.num_cpus=8")


def test_refit_transport_follows_the_engine_and_the_layout() -> None:
    cfg, _ = load_config(None, [], check=False)
    assert _refit_backend(cfg) == "gloo"
    cfg.rollout.engine = "sglang"
    assert _refit_backend(cfg) == "nccl"  # trainer rank 0 and engines on distinct GPUs
    cfg.cluster.colocate = True
    assert _refit_backend(cfg) == "gloo"  # NCCL refuses two ranks on one GPU


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_cluster_stops_the_start_up_with_the_reason(tmp_path: Path) -> None:
    port = _closed_port()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--no-progress", f"cluster.address=127.0.0.1:{port}", "run.num_steps=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PPO_DRIVER_FAIL_AT")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.perf_counter() - t0 < 300
    err = proc.stderr
    assert f"refusing to start: cluster.address=127.0.0.1:{port}" in err, err[-3000:]
    assert "cannot reach the Ray cluster" in err and "ray start --head" in err
    # nothing was trained or written past the run's own bookkeeping
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
