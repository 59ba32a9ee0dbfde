"""Ray nodes for the tests that join a running cluster (``cluster.address``): ``ray start
--block`` processes on 127.0.0.1, each in its own session (its process group holds the
node's processes) with its own temporary directory, ports and logical GPUs, secured by a
token of the test's own.

A test stops only what it started: a node's process group, then any process whose
command line names the node's temporary directory (never `ray stop`, which would stop
every Ray cluster on the machine).
"""

from __future__ import annotations

import contextlib
import os
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
START_TIMEOUT_S = 300.0


def free_ports(count: int) -> list[int]:
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


def node_env() -> dict[str, str]:
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
class Node:
    """One ``ray start --block`` process (its own session, so its process group holds
    the node's processes) with its own temporary directory."""

    name: str
    args: list[str]
    command: list[str] = field(default_factory=lambda: [sys.executable, "-c", RAY_START_LOOPBACK])
    env: dict[str, str] = field(default_factory=dict)
    num_gpus: int = 1
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ppo-rn-", dir="/tmp"))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return Path(self.temp_dir) / f"{self.name}.start.log"

    def start(self) -> None:
        os.makedirs(self.temp_dir, exist_ok=True)
        ports = free_ports(6)
        cmd = [
            *self.command,
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            "--num-cpus=4",
            f"--num-gpus={self.num_gpus}",
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

    def kill(self) -> None:
        """SIGKILL to the node's process group at once (GCS, raylet, the workers it
        started): the node is lost as a crashed machine's would be."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)

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
        for pid in pids_naming(self.temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def pids_naming(text: str) -> list[int]:
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


def bring_up(node: Node, ready: Any, others: list[Node]) -> None:
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


def reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def token_env() -> Iterator[dict[str, str]]:
    """The environment of a token-secured cluster, as `ray start` sets up by default when
    it finds a token: this test's own token (never ~/.ray/auth_token), given to the
    nodes, the CLI and any observer through RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH, as a
    user would. The token is removed at the end."""
    secrets_dir = Path(tempfile.mkdtemp(prefix="ppo-rn-token-", dir="/tmp"))
    try:
        token = secrets_dir / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        yield {**node_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    finally:
        shutil.rmtree(secrets_dir, ignore_errors=True)


def head_node(env: dict[str, str], *, num_gpus: int = 1, resources: str = "") -> tuple[Node, str]:
    """A head node (not started: :func:`bring_up` it with ``head_ready``) and its
    ``127.0.0.1:PORT`` address; ``resources``: a ``--resources`` JSON, if any."""
    port, client_port, dashboard_port = free_ports(3)
    args = ["--head", f"--port={port}", f"--ray-client-server-port={client_port}",
            f"--dashboard-port={dashboard_port}", "--include-dashboard=false"]  # fmt: skip
    if resources:
        args.append(f"--resources={resources}")
    return Node("head", args, env=env, num_gpus=num_gpus), f"127.0.0.1:{port}"


def head_ready(head: Node, address: str) -> bool:
    """The head printed that it is up and its GCS port accepts connections."""
    return head.started() and reachable(int(address.rpartition(":")[2]))
