"""Shared fixtures of the placement tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import ray
from ppo_placement import Slot


def _where_actors_run(slots: list[Slot], *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Start an actor on every slot AT ONCE (so shares must fit), report, then kill them.

    Returns one ``{"node_id", "node_ip", "gpu_ids", "cuda_visible_devices"}`` per slot.
    """

    # Defined here so that Ray pickles it by value (the test modules are not importable
    # inside Ray's worker processes).
    class Where:
        def report(self) -> dict[str, Any]:
            return {
                "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }

    remote_where = ray.remote(Where)
    actors = [remote_where.options(**slot.actor_options()).remote() for slot in slots]
    try:
        return list(ray.get([a.report.remote() for a in actors], timeout=timeout_s))
    finally:
        for actor in actors:
            ray.kill(actor)


@pytest.fixture
def where_actors_run() -> Callable[..., list[dict[str, Any]]]:
    """Start an actor per slot at once and report where each ran (see the helper)."""
    return _where_actors_run
