"""What this machine offers: importable packages, CUDA devices, the local cluster's CPUs.

The rules in ``validate`` read them through this module (``_machine_rules``,
``rollout._engine_rules``), so a test stands in for a missing package or device by
patching :func:`module_available` or :func:`cuda_available` here. No runtime import of
``ppo_driver.config``: ``ppo_driver.config`` re-exports two of these.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ppo_placement import Layout

    from ppo_driver.config.schema import DriverConfig


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported here (not imported: no side effects)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    import torch  # lazy: the CLI's other commands do not need it

    return bool(torch.cuda.is_available())


def cuda_device_count() -> int:
    """CUDA devices this machine has (0 without CUDA)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def local_num_cpus(cfg: DriverConfig, layout: Layout) -> int:
    """The CPUs of the local Ray cluster ``train`` starts: ``cluster.num_cpus``, or by
    default enough for every bundle (one CPU each) and at least
    ``max(4, 2 * actor_gpus + num_engines)``."""
    if cfg.cluster.num_cpus is not None:
        return cfg.cluster.num_cpus
    return max(4, 2 * cfg.cluster.actor_gpus + cfg.rollout.num_engines, layout.num_gpus)
