"""``ppo-driver train`` joins an existing two-node Ray cluster (``cluster.address``).

Two ``ray start --block`` processes on 127.0.0.1, each with its own temporary directory,
ports and one logical GPU (and a custom resource naming it), form the cluster: a head
and a second node (every connection on loopback: see ``RAY_START_LOOPBACK``). The real CLI joins it, runs 3 streaming steps, and exits. Then:

* the trainer processes (actor and critic, one ``_Host`` actor each) ran on one node
  and the engine on the other (the GCS actor table, read by a separate observer
  process that joins the cluster: where each actor of the run lived);
* the start-up log says the same, and that the cluster stays up;
* the cluster is still running afterwards (both nodes alive, both processes up, a task
  still runs): the driver never tears down a cluster it did not start.

The test stops only what it started: the two ``ray start`` process groups, then any
process whose command line names one of its own temporary directories (never `ray
stop`, which would stop every Ray cluster on the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from driver_testlib import TINY_RUN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

# `ray start` replaces a loopback address (`--node-ip-address=127.0.0.1`, and a second
# node's `--address=127.0.0.1:PORT`) by the machine's routable one
# (services.resolve_ip_for_localhost), and its switch against that
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) refuses worker nodes. The test keeps every
# connection on loopback: the same `ray start` command, with that one replacement off.
RAY_START_LOOPBACK = (
    "import sys; import ray._private.services as s; "
    "s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)
NUM_STEPS = 3
START_TIMEOUT_S = 300.0


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _node_env() -> dict[str, str]:
    # An in-process start_local_ray earlier in this pytest process (the placement tests)
    # leaves its loopback-only switch in os.environ, which makes `ray start` refuse the
    # second node: the nodes get the environment without it.
    dropped = ("RAY_ADDRESS", "PPO_DRIVER_FAIL_AT", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
        RAY_agent_register_timeout_ms="120000",
        RAY_worker_register_timeout_seconds="180",
    )
    return env


@dataclass
class _Node:
    """One ``ray start --block`` process (its own session, so its process group holds
    the node's processes) with its own temporary directory."""

    name: str
    args: list[str]
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ppo-rn-", dir="/tmp"))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return Path(self.temp_dir) / f"{self.name}.start.log"

    def start(self) -> None:
        os.makedirs(self.temp_dir, exist_ok=True)
        ports = _free_ports(6)
        cmd = [
            *self.command,
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            "--num-cpus=4",
            "--num-gpus=1",
            "--object-store-memory=150000000",
            f"--node-manager-port={ports[0]}",
            f"--object-manager-port={ports[1]}",
            f"--dashboard-agent-listen-port={ports[2]}",
            f"--dashboard-agent-grpc-port={ports[3]}",
            f"--runtime-env-agent-port={ports[4]}",
            f"--metrics-export-port={ports[5]}",
            *self.args,
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def started(self) -> bool:
        """`ray start` printed that the node is up (GCS, raylet and agents)."""
        return self.log.exists() and "Ray runtime started." in self.log.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the node's process group, SIGKILL what is left, then any process
        naming this node's temporary directory; the directory is removed."""
        if self.proc is not None:
            # the group outlives its leader while members are left: SIGKILL them all
            for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=wait_s)
        for pid in _pids_naming(self.temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (this test's own temp dirs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


START_ATTEMPTS = 3


def _bring_up(node: _Node, ready: Any, others: list[_Node]) -> None:
    """Start ``node`` until ``ready()``; a start that fails (on a loaded machine the
    raylet can give up on its agents: "The current node timed out during startup", see
    ppo_placement's start_local_ray) is cleaned up and tried again, after the agents'
    imports were warmed."""
    reason = ""
    for _ in range(START_ATTEMPTS):
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray.dashboard.agent, ray._private.runtime_env.agent.main",
            ],
            check=False,
            timeout=600,
            capture_output=True,
        )
        node.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            for other in others:
                if not other.running():
                    pytest.fail(f"ray start ({other.name}) exited:\n{other.tail()}")
            if not node.running():
                break
            if time.monotonic() > deadline:
                pytest.fail(f"timed out starting the {node.name} node:\n{node.tail()}")
            time.sleep(1.0)
        else:
            return
        reason = node.tail()
        node.stop()
    pytest.fail(f"ray start ({node.name}) failed {START_ATTEMPTS} times; the last:\n{reason}")


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


# Joins the cluster as a separate driver and prints, as JSON, the alive nodes (by their
# custom resource), the actors of every other job (class, node), and, with "task", the
# node a task pinned to the second node ran on. The test process itself never joins.
OBSERVE = """
import json, sys, time
import ray
from ppo_placement import join_ray

address, wait_s, task = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "task"
join_ray(address, log_to_driver=False)

def alive():
    out = {}
    for node in ray.nodes():
        for key in ("ppo_test_head", "ppo_test_second"):
            if node["Alive"] and key in node["Resources"]:
                out[key] = node["NodeID"]
    return out

deadline = time.monotonic() + wait_s
while len(alive()) < 2 and time.monotonic() < deadline:
    time.sleep(1.0)
mine = ray.get_runtime_context().get_job_id()
actors = [
    {"class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
    for a in ray._private.state.actors().values()
    if a["JobID"] != mine
]
out = {"nodes": alive(), "actors": actors}
if task:
    @ray.remote(num_cpus=1, resources={"ppo_test_second": 0.01})
    def where():
        return ray.get_runtime_context().get_node_id()
    out["task_node"] = ray.get(where.remote(), timeout=300)
print("OBSERVED " + json.dumps(out))
"""


@dataclass
class _Cluster:
    address: str
    head: _Node
    second: _Node
    env: dict[str, str]

    def observe(self, *, wait_s: float = 0.0, task: bool = False) -> dict[str, Any]:
        cmd = [sys.executable, "-c", OBSERVE, self.address, str(wait_s), "task" if task else "-"]
        proc = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=wait_s + 600, check=False
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("OBSERVED ")]
        assert proc.returncode == 0 and lines, proc.stderr[-4000:]
        return dict(json.loads(lines[-1][len("OBSERVED ") :]))


@pytest.fixture(scope="module")
def cluster() -> Iterator[_Cluster]:
    # A token-secured cluster, as `ray start` sets up by default when it finds a token:
    # this test's own token (never ~/.ray/auth_token), given to the nodes, the CLI and
    # the observer through RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH, as a user would.
    secrets_dir = Path(tempfile.mkdtemp(prefix="ppo-rn-token-", dir="/tmp"))
    token = secrets_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**_node_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    (port, client_port, dashboard_port) = _free_ports(3)
    head = _Node(
        "head",
        ["--head", f"--port={port}", f"--ray-client-server-port={client_port}",
         f"--dashboard-port={dashboard_port}",
         "--include-dashboard=false", '--resources={"ppo_test_head": 1}'],
        command=[sys.executable, "-c", RAY_START_LOOPBACK],
        env=env,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    second = _Node(
        "second",
        [f"--address={address}", '--resources={"ppo_test_second": 1}'],
        command=[sys.executable, "-c", RAY_START_LOOPBACK],
        env=env,
    )
    try:
        _bring_up(head, lambda: head.started() and _reachable(port), [])
        _bring_up(second, second.started, [head])
        found = _Cluster(address, head, second, env)
        nodes = found.observe(wait_s=START_TIMEOUT_S)["nodes"]
        if len(nodes) < 2:
            pytest.fail(f"one node is missing ({nodes}):\n{head.tail()}\n{second.tail()}")
        yield found
    finally:
        second.stop()
        head.stop()
        shutil.rmtree(secrets_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def joined_run(cluster: _Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The CLI's run on the cluster: its stderr, its metrics rows, and what the cluster
    looks like afterwards (nodes, the run's actors, a task on the second node)."""
    run_dir = tmp_path_factory.mktemp("joined") / "run"
    cmd = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--no-progress", *TINY_RUN, f"run.num_steps={NUM_STEPS}", "rollout.max_new_tokens=8"]
    cmd += [f"cluster.address={cluster.address}"]
    proc = subprocess.run(
        cmd, env=cluster.env, capture_output=True, text=True, timeout=1500, check=False
    )
    (run_dir.parent / "stderr.log").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    after = cluster.observe(task=True)
    return {"stderr": proc.stderr, "rows": rows, **after}


def test_three_streaming_steps_on_the_joined_cluster(joined_run: dict[str, Any]) -> None:
    rows = joined_run["rows"]
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    assert all(int(r["train/chunks"]) >= 1 for r in rows)
    err = joined_run["stderr"]
    assert "ppo-driver: streaming, 8 prompts x 2 samples per step, minimum 2 groups" in err
    assert re.search(r"joined the Ray cluster at 127\.0\.0\.1:\d+ \(2 node\(s\), 2 GPU", err), err
    assert "it stays up after the run" in err


def test_trainers_on_one_node_engine_on_the_other(joined_run: dict[str, Any]) -> None:
    ids = joined_run["nodes"]
    run_actors = [a for a in joined_run["actors"] if a["class"] in ("_Host", "EmbeddedEngine")]
    trainers = [a for a in run_actors if a["class"] == "_Host"]
    engines = [a for a in run_actors if a["class"] == "EmbeddedEngine"]
    assert len(trainers) == 2 and len(engines) == 1, run_actors  # actor, critic; the engine
    assert all(a["state"] == "DEAD" for a in run_actors)  # the run cleaned up its actors
    trainer_nodes = {a["node"] for a in trainers}
    engine_nodes = {a["node"] for a in engines}
    assert len(trainer_nodes) == 1 and len(engine_nodes) == 1
    assert trainer_nodes != engine_nodes
    assert trainer_nodes | engine_nodes == set(ids.values())
    # the driver's start-up log names the same nodes
    line = re.search(
        r"placement: actor and critic ranks on (.*); engines on (.*)", joined_run["stderr"]
    )
    assert line is not None, joined_run["stderr"][-3000:]
    (trainer_node,) = trainer_nodes
    (engine_node,) = engine_nodes
    assert f"(node {trainer_node[:12]})" in line.group(1)
    assert f"(node {engine_node[:12]})" in line.group(2)


def test_the_cluster_keeps_running_after_the_run(
    cluster: _Cluster, joined_run: dict[str, Any]
) -> None:
    assert cluster.head.running() and cluster.second.running()
    assert set(joined_run["nodes"]) == {"ppo_test_head", "ppo_test_second"}
    assert joined_run["task_node"] == joined_run["nodes"]["ppo_test_second"]
