"""SharedPlacement's pure parts: argument checks and the bundle order (no Ray start)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from ppo_placement import SharedPlacement, placement_layout
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
