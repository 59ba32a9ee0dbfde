"""SharedPlacement across two Ray nodes on one machine (``start_local_ray(nodes=2)``,
which uses ray.cluster_utils.Cluster).

Each node has 4 logical GPUs (ids 0..3 on both); both share the IP 127.0.0.1, so the
bundle order falls back to the node id between nodes and to the GPU id within one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from ppo_placement import (
    LocalRay,
    SharedPlacement,
    placement_layout,
    shutdown_local_ray,
    start_local_ray,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

Where = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[LocalRay]:
    shutdown_local_ray()
    # Two ray.cluster_utils.Cluster nodes, started (with retries) by the project's helper.
    info = start_local_ray(nodes=2, num_cpus=4, num_gpus=4, log_to_driver=False)
    try:
        yield info
    finally:
        shutdown_local_ray()


def test_two_nodes_are_up_and_reused(two_nodes: LocalRay) -> None:
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2
    assert {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    assert [n["Resources"]["GPU"] for n in alive] == [4.0, 4.0]
    assert not start_local_ray(nodes=2, num_gpus=4).started
    with pytest.raises(ValueError, match=r"nodes=3: .* 2 node\(s\) of 4 GPU"):
        start_local_ray(nodes=3)


def test_workers_of_every_node_run_at_this_process_priority(two_nodes: LocalRay) -> None:
    # start_local_ray's default worker_niceness (0) reaches the second node's raylet too
    @ray.remote(num_cpus=0)
    def nice() -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.nice(0)

    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    on = [
        nice.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in alive
    ]
    assert sorted(ray.get(on, timeout=120)) == [(node, os.nice(0)) for node in alive]


def test_ranks_fill_a_node_before_the_next(two_nodes: LocalRay, where_actors_run: Where) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    layout = placement_layout(actor_gpus=6, rollout_gpus=2)
    with SharedPlacement(layout, strategy="PACK") as placement:
        bundles = placement.bundles
        assert len(bundles) == 8
        nodes = [b.node_id for b in bundles]
        first, second = nodes[0], nodes[4]
        assert first != second and nodes == [first] * 4 + [second] * 4
        assert first < second  # same IP: ordered by node id
        assert {b.node_ip for b in bundles} == {"127.0.0.1"}
        assert [b.gpu_id for b in bundles] == [0, 1, 2, 3, 0, 1, 2, 3]

        actor, critic, rollout = (
            placement.actor_view(),
            placement.critic_view(),
            placement.rollout_view(),
        )
        assert actor.node_boundaries == (range(0, 4), range(4, 6))
        assert [s.node_rank for s in actor] == [0, 0, 0, 0, 1, 1]
        assert [s.local_rank for s in actor] == [0, 1, 2, 3, 0, 1]
        assert actor.node_ips == ("127.0.0.1", "127.0.0.1")
        for a, c in zip(actor, critic, strict=True):
            assert (a.node_id, a.gpu_id, a.bundle_index) == (c.node_id, c.gpu_id, c.bundle_index)
        # Rollout: the last two GPUs of the second node, disjoint from training.
        assert [(s.node_id, s.gpu_id) for s in rollout] == [(second, 2), (second, 3)]
        assert rollout.node_boundaries == (range(0, 2),)
        assert not {s.bundle_index for s in rollout} & {s.bundle_index for s in actor}

        # Real actors (kept few: 2 cores): actor and critic of a rank on each node, and
        # a rollout engine, all at once.
        slots = [actor[3], critic[3], actor[4], critic[4], rollout[1]]
        reports = where_actors_run(slots)
        for slot, report in zip(slots, reports, strict=True):
            assert report["node_id"] == slot.node_id, slot
            assert report["gpu_ids"] == [slot.gpu_id], slot


def test_bundles_without_gpu_ids_find_their_nodes(
    two_nodes: LocalRay, where_actors_run: Where
) -> None:
    # No probe task (probe_gpu_ids=False): each bundle's node comes from Ray's
    # placement group table, and the ranks still fill a node before the next.
    layout = placement_layout(actor_gpus=6, rollout_gpus=2)
    with SharedPlacement(layout, strategy="PACK", probe_gpu_ids=False) as placement:
        bundles = placement.bundles
        nodes = [b.node_id for b in bundles]
        first, second = nodes[0], nodes[4]
        assert first < second and nodes == [first] * 4 + [second] * 4
        assert [b.gpu_id for b in bundles] == [None] * 8
        actor, critic = placement.actor_view(), placement.critic_view()
        assert actor.node_boundaries == (range(0, 4), range(4, 6))
        slots = [actor[3], critic[3], actor[4], critic[4]]
        for slot, report in zip(slots, where_actors_run(slots), strict=True):
            assert report["node_id"] == slot.node_id, slot
