"""On a machine with real CUDA GPUs: the slots' actors get the bundle's device.

Skipped without CUDA: without nvidia-smi, without torch (not a dependency of this
package) or without a visible GPU.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest
from ppo_placement import SharedPlacement, placement_layout, shutdown_local_ray, start_local_ray


def _cuda_device_count() -> int:
    if shutil.which("nvidia-smi") is None:  # skip the (slow) torch import on CPU boxes
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_device_count() == 0, reason="needs a CUDA GPU")
def test_colocated_roles_see_the_bundles_real_gpu(
    where_actors_run: Callable[..., list[dict[str, Any]]],
) -> None:
    shutdown_local_ray()
    gpus = _cuda_device_count()
    start_local_ray(num_gpus=gpus, log_to_driver=False)
    try:
        layout = placement_layout(actor_gpus=gpus, rollout_gpus=gpus, colocate=True)
        with SharedPlacement(layout) as placement:
            assert [b.gpu_id for b in placement.bundles] == list(range(gpus))
            actor, critic, rollout = (
                placement.actor_view(),
                placement.critic_view(),
                placement.rollout_view(),
            )
            slots = [actor[0], critic[0], rollout[0]]
            reports = where_actors_run(slots)
            for slot, report in zip(slots, reports, strict=True):
                assert report["gpu_ids"] == [slot.gpu_id]
                # Ray exposes exactly the bundle's device to the process.
                assert report["cuda_visible_devices"] == str(slot.gpu_id)
    finally:
        shutdown_local_ray()
