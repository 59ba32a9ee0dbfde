"""SharedPlacement's pure parts: argument checks and the bundle order (no Ray start)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, cast

import pytest
from ppo_placement import Bundle, SharedPlacement, placement_layout
from ppo_placement._placement import order_bundles


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"strategy": "BEST"}, r"strategy='BEST' must be one of", id="strategy"),
        pytest.param({"bundle_resources": {}}, r"bundle_resources=\{\}", id="empty-bundle"),
        pytest.param(
            {"bundle_resources": {"GPU": 1, "CPU": -1}}, r"none negative", id="negative-bundle"
        ),
        pytest.param({"ready_timeout_s": 0}, r"ready_timeout_s=0", id="timeout"),
        pytest.param({"gpu_shares": {"ref": 0.1}}, r"unknown roles \['ref'\]", id="unknown-role"),
        pytest.param({"gpu_shares": {"actor": 0.0}}, r"gpu_shares\['actor'\]=0.0", id="zero-share"),
        pytest.param(
            {"gpu_shares": {"critic": 1.5}}, r"gpu_shares\['critic'\]=1.5", id="big-share"
        ),
        pytest.param(
            {"gpu_shares": {"actor": 0.7}}, r"\['actor', 'critic'\] add up to 1.2", id="overfull"
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SharedPlacement(placement_layout(actor_gpus=2, rollout_gpus=2), **kwargs)


def test_colocated_shares_must_fit_with_rollout() -> None:
    layout = placement_layout(actor_gpus=2, rollout_gpus=2, colocate=True)
    with pytest.raises(ValueError, match=r"\['actor', 'critic', 'rollout'\] add up to 1.1"):
        SharedPlacement(layout, gpu_shares={"actor": 0.5, "critic": 0.4})
    SharedPlacement(layout, gpu_shares={"actor": 0.45, "critic": 0.45, "rollout": 0.1})
    # Not colocated: the rollout share is its own bundle's business.
    SharedPlacement(placement_layout(actor_gpus=2, rollout_gpus=2), gpu_shares={"rollout": 1.0})


def test_views_need_create() -> None:
    placement = SharedPlacement(placement_layout(actor_gpus=1, rollout_gpus=1))
    assert not placement.created and placement.placement_group is None
    for ask in (placement.actor_view, placement.critic_view, placement.rollout_view):
        with pytest.raises(RuntimeError, match=r"call create\(\) before"):
            ask()
    placement.teardown()  # nothing created: a no-op


def test_bundles_order_by_ip_as_numbers_then_node_then_gpu_as_int() -> None:
    expected = [
        ("10.0.0.9", "node-b", "2"),
        ("10.0.0.9", "node-b", "10"),  # GPU 10 after GPU 2
        ("10.0.0.10", "node-a", "0"),  # 10.0.0.10 after 10.0.0.9
        ("10.0.0.10", "node-a", "1"),
        ("10.0.1.2", "node-c", "0"),
        ("127.0.0.1", "node-d", "3"),  # same IP, two nodes: by node id
        ("127.0.0.1", "node-e", "0"),
    ]
    raw = [(i, ip, node, [gpu]) for i, (ip, node, gpu) in enumerate(expected)]
    random.Random(0).shuffle(raw)
    ordered = order_bundles(raw)
    assert [(b.node_ip, b.node_id, str(b.gpu_id)) for b in ordered] == expected
    assert [b.index for b in ordered] == list(range(len(expected)))
    assert [b.bundle_index for b in ordered] == list(range(len(expected)))
    assert all(isinstance(b.gpu_id, int) for b in ordered)


def test_bundles_without_gpus_and_with_too_many() -> None:
    (bundle,) = order_bundles([(0, "127.0.0.1", "n", [])])
    assert bundle.gpu_id is None
    with pytest.raises(ValueError, match=r"bundle 3 holds 2 GPUs"):
        order_bundles([(3, "127.0.0.1", "n", ["0", "1"])])


def test_bundle_resources_may_hold_a_zero_amount_but_not_only_zeros() -> None:
    layout = placement_layout(actor_gpus=2, rollout_gpus=2)
    SharedPlacement(layout, bundle_resources={"GPU": 1, "CPU": 0})  # GPU only
    with pytest.raises(ValueError, match="at least one positive amount"):
        SharedPlacement(layout, bundle_resources={"GPU": 0, "CPU": 0})


def test_bundles_order_ties_by_ray_index_strings_and_names_last() -> None:
    # one node without GPU ids: Ray's bundle order, whatever order they were found in
    raw = [(i, "10.0.0.1", "n", []) for i in (3, 0, 2, 1)]
    assert [b.bundle_index for b in order_bundles(raw)] == [0, 1, 2, 3]
    # GPU ids that are not numbers come after the numbered ones, in text order
    raw = [(i, "10.0.0.1", "n", [g]) for i, g in enumerate(["GPU-b", "1", "GPU-a", "0"])]
    assert [b.gpu_id for b in order_bundles(raw)] == [0, 1, "GPU-a", "GPU-b"]
    # IPv4 before IPv6, and a name that is no IP address last
    raw = [(0, "host-a", "n0", ["0"]), (1, "::1", "n1", ["0"]), (2, "10.0.0.1", "n2", ["0"])]
    assert [b.node_ip for b in order_bundles(raw)] == ["10.0.0.1", "::1", "host-a"]


def _created(placement: SharedPlacement, bundles: list[Bundle]) -> SharedPlacement:
    """``placement`` as ``create()`` leaves it, with ``bundles`` (no Ray start)."""
    placement._bundles = tuple(bundles)
    placement._pg = cast(Any, "the placement group")
    placement._created = True
    return placement


def test_views_hand_out_shares_ranks_and_ray_bundle_indices() -> None:
    # Two nodes with their own IPs and two on one machine (same IP); Ray's bundle
    # indices are not the order's.
    where = [("10.0.0.1", "a"), ("10.0.0.1", "a"), ("10.0.0.2", "b"), ("10.0.0.3", "c")]
    where += [("10.0.0.3", "d"), ("10.0.0.3", "d")]
    bundles = [
        Bundle(index=k, bundle_index=5 - k, node_id=node, node_ip=ip, gpu_id=k % 2)
        for k, (ip, node) in enumerate(where)
    ]
    layout = placement_layout(actor_gpus=4, rollout_gpus=2)
    placement = _created(SharedPlacement(layout, bundle_resources={"GPU": 1, "CPU": 4}), bundles)
    actor, critic, rollout = (
        placement.actor_view(),
        placement.critic_view(),
        placement.rollout_view(),
    )
    assert [s.bundle for s in actor] == [s.bundle for s in critic] == bundles[:4]
    assert [s.bundle for s in rollout] == bundles[4:]
    assert actor.node_boundaries == (range(0, 2), range(2, 3), range(3, 4))
    assert actor.node_ips == ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    assert [(s.node_rank, s.local_rank) for s in actor] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    assert [(s.node_rank, s.local_rank) for s in rollout] == [(0, 0), (0, 1)]
    assert rollout.node_ips == ("10.0.0.3",) and rollout.gpu_ids == (0, 1)
    for slot in actor:
        options = slot.actor_options()
        assert (options["num_gpus"], options["num_cpus"]) == (0.5, 2.0)  # half of 1 GPU, 4 CPUs
        strategy = options["scheduling_strategy"]
        assert strategy.placement_group == "the placement group"
        assert strategy.placement_group_bundle_index == slot.bundle.bundle_index
        assert slot.bundle_index == 5 - slot.bundle.index
    assert {(s.num_gpus, s.num_cpus) for s in rollout} == {(1.0, 4.0)}
    # same IP, two nodes: told apart by node id
    cpu_only = _created(
        SharedPlacement(layout, bundle_resources={"CPU": 2}),
        [dataclasses.replace(b, node_ip="127.0.0.1") for b in bundles],
    )
    view = cpu_only.actor_view()
    assert view.node_boundaries == (range(0, 2), range(2, 3), range(3, 4))
    assert view.node_ips == ("127.0.0.1",) * 3
    assert {(s.num_gpus, s.num_cpus) for s in view} == {(0.0, 1.0)}  # no GPU to share
