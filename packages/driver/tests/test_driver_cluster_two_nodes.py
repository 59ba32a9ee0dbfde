"""``ppo-driver train`` joins an existing two-node Ray cluster (``cluster.address``).

Two ``ray start --block`` processes on 127.0.0.1, each with its own temporary directory,
ports and one logical GPU (and a custom resource naming it), form the cluster: a head
and a second node (every connection on loopback: see ``ray_cluster_testlib``). The real
CLI joins it, runs 3 streaming steps, and exits. Then:

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

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from driver_testlib import TINY_RUN
from ray_cluster_testlib import (
    START_TIMEOUT_S,
    Node,
    bring_up,
    head_node,
    head_ready,
    token_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

NUM_STEPS = 3


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
    head: Node
    second: Node
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
    with token_env() as env:
        head, address = head_node(env, resources='{"ppo_test_head": 1}')
        second = Node("second", [f"--address={address}", '--resources={"ppo_test_second": 1}'],
                      env=env)  # fmt: skip
        try:
            bring_up(head, lambda: head_ready(head, address), [])
            bring_up(second, second.started, [head])
            found = _Cluster(address, head, second, env)
            nodes = found.observe(wait_s=START_TIMEOUT_S)["nodes"]
            if len(nodes) < 2:
                pytest.fail(f"one node is missing ({nodes}):\n{head.tail()}\n{second.tail()}")
            yield found
        finally:
            second.stop()
            head.stop()


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
    assert (
        "ppo-driver: streaming (chunks by arrival), 8 prompts x 2 samples per step, minimum 2"
        in err
    )
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
