"""The Ray cluster a run uses: a local one started for it, or an existing one joined
(checked for the resources the layout reserves)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray
from ppo_placement import (
    Layout,
    RayJoinError,
    RoleView,
    SharedPlacement,
    join_ray,
    start_local_ray,
)

from ppo_driver.config import (
    DriverConfig,
    cuda_device_count,
    local_num_cpus,
)
from ppo_driver.startup import StartupError
from ppo_driver.workers import WORKER_ENV

log = logging.getLogger("ppo_driver")


def _connect_cluster(
    cfg: DriverConfig,
    layout: Layout,
    *,
    keep_ray: bool,
    on_exit: Callable[[str, Callable[[], object]], None],
) -> bool:
    """``cluster.address`` null: start a local Ray cluster with the layout's (logical)
    GPUs, its processes in the worker environment (:data:`WORKER_ENV`), shut down at
    the end. Else join the existing cluster there; at the end the driver only
    disconnects (``ray.shutdown()`` in a joined driver stops nothing of the cluster): it
    never tears down a cluster it did not start.

    Returns whether the cluster's GPU ids can name devices: ``False`` for a local
    cluster on a machine without CUDA devices, whose GPUs are logical only (the
    placement then starts no probe task to learn them)."""
    started_here = not ray.is_initialized()
    address = cfg.cluster.address
    if address is None:
        if started_here and not keep_ray:
            on_exit("ray.shutdown", ray.shutdown)
        devices = cuda_device_count()
        start_local_ray(
            num_gpus=layout.num_gpus if cfg.cluster.logical_gpus else devices,
            num_cpus=local_num_cpus(cfg, layout),
            worker_env=WORKER_ENV,
            # the ranks and engines at the driver's own priority (Ray's default lowers
            # them by 15: on a busy machine they would yield to everything else)
            worker_niceness=0,
        )
        return devices > 0
    try:
        joined = join_ray(address)
    except (ValueError, RayJoinError) as exc:
        raise StartupError(f"cluster.address={address}: {exc}") from None
    if started_here and not keep_ray:
        on_exit("leaving the Ray cluster (it keeps running)", ray.shutdown)
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    gpus, cpus = float(total.get("GPU", 0.0)), float(total.get("CPU", 0.0))
    if gpus < layout.num_gpus or cpus < layout.num_gpus:
        raise StartupError(
            f"cluster.address={address}: the cluster has {gpus:g} GPU(s) and {cpus:g} CPU(s) "
            f"on {len(nodes)} node(s), but this run reserves {layout.num_gpus} bundles of 1 GPU "
            f"+ 1 CPU (cluster.actor_gpus={cfg.cluster.actor_gpus} for actor and critic, "
            f"cluster.rollout_gpus={cfg.cluster.rollout_gpus}"
            f"{', colocated' if layout.colocate else ''}); add nodes or GPUs (`ray start "
            "--num-gpus=N`), or ask for fewer"
        )
    log.info(
        "start-up: joined the Ray cluster at %s (%d node(s), %g GPU(s), %g CPU(s)); it stays "
        "up after the run",
        joined.address,
        len(nodes),
        gpus,
        cpus,
    )
    return True


def _where(placement: SharedPlacement) -> str:
    """Which nodes hold the training ranks and the engines (for the start-up log)."""

    def nodes(view: RoleView) -> str:
        seen: dict[str, str] = {}
        for slot in view:
            seen.setdefault(slot.node_id, slot.node_ip)
        return ", ".join(f"{ip} (node {node_id[:12]})" for node_id, ip in seen.items())

    return (
        f"actor and critic ranks on {nodes(placement.actor_view())}; engines on "
        f"{nodes(placement.rollout_view())}"
    )
