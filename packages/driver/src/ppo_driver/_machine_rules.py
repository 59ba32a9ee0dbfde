"""The machine's and the cluster's rules in ``validate``: the cluster address or the
local cluster's CPUs and GPUs (``ppo_driver._cluster`` starts or joins it), the offload
backend on this machine's device (as ``ppo_trainer.memory_saver_problem`` states it), and
the optional tensorboard extra (sglang's is ``rollout._engine_rules``'s).
"""

from __future__ import annotations

from collections.abc import Collection

from ppo_placement import cluster_address_problem
from ppo_trainer import OFFLOAD_BACKENDS, memory_saver_problem, offload_backend_name

from ppo_driver import _machine
from ppo_driver.config.packages import ROLES, cluster_layout
from ppo_driver.config.problems import ConfigProblem, warning
from ppo_driver.config.schema import DriverConfig

TENSORBOARD_EXTRA = "ppo-driver[tensorboard]"


def cluster_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """``cluster.address``: null (a local cluster, :func:`local_cluster_problems`),
    ``auto`` or ``host:port`` (join: the nodes' ``ray start`` decide the resources)."""
    c = cfg.cluster
    if c.address is None:
        return local_cluster_problems(cfg)
    out = []
    joined = "has no effect when joining a cluster (cluster.address is set): its nodes' "
    if not c.logical_gpus:
        out.append(
            warning(
                "cluster.logical_gpus",
                False,
                joined + "`ray start --num-gpus` decide the GPUs",
                "remove cluster.logical_gpus",
            )
        )
    problem = cluster_address_problem(c.address)
    if problem is not None:
        head, fix = problem
        out.append(
            ConfigProblem(
                "cluster.address", c.address, head, f"{fix}, or null to start a local cluster"
            )
        )
    if c.num_cpus is not None:
        out.append(
            warning(
                "cluster.num_cpus",
                c.num_cpus,
                joined + "`ray start --num-cpus/--num-gpus` decide the resources",
                "remove cluster.num_cpus",
            )
        )
    return out


def local_cluster_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """The local cluster: each bundle the layout reserves takes one CPU of
    ``cluster.num_cpus`` and one GPU (``cluster.logical_gpus=false``: one of the machine's
    CUDA devices)."""
    c = cfg.cluster
    try:
        needed = cluster_layout(cfg).num_gpus
    except ValueError:
        return []  # the layout's own error is reported already
    out = []
    if c.num_cpus is not None and 0 < c.num_cpus < needed:
        out.append(
            ConfigProblem(
                "cluster.num_cpus",
                c.num_cpus,
                f"the layout reserves {needed} bundle(s) of 1 GPU + 1 CPU (cluster.actor_gpus="
                f"{c.actor_gpus}, cluster.rollout_gpus={c.rollout_gpus}), more than the local "
                "cluster's CPUs: the placement group could never be created",
                f"set cluster.num_cpus to at least {needed}, or null (enough for the layout)",
            )
        )
    have = None if c.logical_gpus else _machine.cuda_device_count()
    if have is not None and have < needed:
        out.append(
            ConfigProblem(
                "cluster.logical_gpus",
                False,
                f"this machine has {have} CUDA device(s), and the layout reserves {needed} "
                f"(cluster.actor_gpus={c.actor_gpus}, cluster.rollout_gpus={c.rollout_gpus})",
                "set cluster.logical_gpus=true (logical GPUs: CPU runs and tests), ask for "
                "fewer GPUs, or run on a machine with enough",
            )
        )
    return out


def tensorboard_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """``run.tensorboard`` needs the tensorboard package (an optional extra)."""
    if not cfg.run.tensorboard or _machine.module_available("tensorboard"):
        return []
    return [
        ConfigProblem(
            "run.tensorboard",
            True,
            "writing TensorBoard event files needs the tensorboard package, which is not installed",
            f"install the extra {TENSORBOARD_EXTRA} (in this workspace: `uv sync --extra "
            "tensorboard`), or set run.tensorboard=false (metrics.jsonl is written either way)",
        )
    ]


def offload_problems(cfg: DriverConfig, *, refused: Collection[str]) -> list[ConfigProblem]:
    """``policy/critic.offload_backend`` on this machine's device, as the trainer's
    backends resolve it (``ppo_trainer.memory_saver_problem``: ``memory_saver`` needs
    CUDA, torch_memory_saver and the torch backend); ``none`` (offload off, the shared
    actor/critic report's debugging switch) is warned about. An unknown name, or a key
    in ``refused``, is the trainer's config check."""
    out = []
    for role in ROLES:
        m, key = cfg.model(role), f"{role}.offload_backend"
        name = offload_backend_name(m.offload_backend)  # as the trainer reads it
        if name not in OFFLOAD_BACKENDS or key in refused:
            continue
        if name == "none":
            out.append(
                warning(
                    key,
                    "none",
                    f"offload is off: the {role} stays on the training devices while the other "
                    "model works, so both models and their optimizer states must fit there "
                    "at once (for debugging offload only)",
                    f"set {key}=auto to time-share the devices",
                )
            )
        if name == "memory_saver":
            device = "cuda" if _machine.cuda_available() else "cpu"
            backend = "megatron" if m.megatron_cfg.enabled else "torch"
            problem = memory_saver_problem(device=device, backend=backend, key=key)
            if problem is not None:
                out.append(ConfigProblem(key, m.offload_backend, *problem))
    return out
