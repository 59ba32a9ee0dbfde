"""ppo_driver: streaming colocated PPO (actor and critic share the training devices,
generation runs on its own), its config, train pump, checkpoints and CLI.

Every name loads on first use, so that ``import ppo_driver`` and ``ppo-driver --help``
stay fast: the config loads torch (it builds the trainer's own typed configs), the run
loads Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the real types of the lazy names, for type checkers
    from ppo_driver.batch import ChunkBatch, StepBatch
    from ppo_driver.checkpoint import (
        CheckpointDamaged,
        find_latest,
        load_checkpoint,
        save_checkpoint,
        verify_checkpoint,
    )
    from ppo_driver.config import (
        ConfigError,
        ConfigProblem,
        DriverConfig,
        ValidationReport,
        ValidConfig,
        default_config_path,
        load_config,
        validate,
        validated,
    )
    from ppo_driver.metrics import MetricsWriter, plot_rewards
    from ppo_driver.pump import ChunkGate, InjectedFailure, NonFiniteError, StepReport, TrainPump
    from ppo_driver.rollout import ClusterLost, RewardFailure
    from ppo_driver.run import RunFailed, RunResult, RunStopped, train
    from ppo_driver.startup import StartupError
    from ppo_driver.trace import TraceRecorder
    from ppo_driver.workers import TrainGroup, WorkerLost

__version__ = "0.8.1"

_LAZY = {
    "ConfigError": "ppo_driver.config",
    "ConfigProblem": "ppo_driver.config",
    "DriverConfig": "ppo_driver.config",
    "ValidConfig": "ppo_driver.config",
    "ValidationReport": "ppo_driver.config",
    "default_config_path": "ppo_driver.config",
    "load_config": "ppo_driver.config",
    "validate": "ppo_driver.config",
    "validated": "ppo_driver.config",
    "ChunkGate": "ppo_driver.pump",
    "InjectedFailure": "ppo_driver.pump",
    "NonFiniteError": "ppo_driver.metrics",
    "RunStopped": "ppo_driver.run",
    "RunFailed": "ppo_driver.run",
    "StartupError": "ppo_driver.startup",
    "CheckpointDamaged": "ppo_driver.checkpoint",
    "verify_checkpoint": "ppo_driver.checkpoint",
    "RewardFailure": "ppo_driver.rollout",
    "ClusterLost": "ppo_driver.rollout",
    "StepReport": "ppo_driver.pump",
    "TrainPump": "ppo_driver.pump",
    "ChunkBatch": "ppo_driver.batch",
    "StepBatch": "ppo_driver.batch",
    "RunResult": "ppo_driver.run",
    "train": "ppo_driver.run",
    "TrainGroup": "ppo_driver.workers",
    "WorkerLost": "ppo_driver.workers",
    "find_latest": "ppo_driver.checkpoint",
    "load_checkpoint": "ppo_driver.checkpoint",
    "save_checkpoint": "ppo_driver.checkpoint",
    "TraceRecorder": "ppo_driver.trace",
    "MetricsWriter": "ppo_driver.metrics",
    "plot_rewards": "ppo_driver.metrics",
}

__all__ = [
    "CheckpointDamaged",
    "ChunkBatch",
    "ChunkGate",
    "ClusterLost",
    "ConfigError",
    "ConfigProblem",
    "DriverConfig",
    "InjectedFailure",
    "MetricsWriter",
    "NonFiniteError",
    "RewardFailure",
    "RunFailed",
    "RunResult",
    "RunStopped",
    "StartupError",
    "StepBatch",
    "StepReport",
    "TraceRecorder",
    "TrainGroup",
    "TrainPump",
    "ValidConfig",
    "ValidationReport",
    "WorkerLost",
    "__version__",
    "default_config_path",
    "find_latest",
    "load_checkpoint",
    "load_config",
    "plot_rewards",
    "save_checkpoint",
    "train",
    "validate",
    "validated",
    "verify_checkpoint",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ppo_driver' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
