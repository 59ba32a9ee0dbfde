"""ppo_lifecycle: idempotent sleep/wake_up with gradients kept resident.

The driver owns the plan (:func:`plan_transitions`, its residency state in
:class:`ResidencyPlanner`, checked by :class:`ResidencyLedger`); trainer workers own
the mechanism (:class:`OffloadManager`, which implements :class:`Offloadable`).
"""

from ._backends import HostCopyBackend, OffloadBackend, TorchMemorySaverBackend
from ._ledger import ResidencyError, ResidencyLedger
from ._manager import OffloadManager
from ._parts import ALL_PARTS, BACKWARD_PARTS, FORWARD_PARTS, KEEP_GRADIENTS, Part
from ._plan import (
    Action,
    Phase,
    PlanStep,
    Role,
    Transition,
    Work,
    phase_parts,
    plan_transitions,
)
from ._planner import CallPlan, ResidencyPlanner
from ._protocol import Offloadable
from ._tensors import StorageAliasError, check_gradient_isolation

__version__ = "0.3.2"

__all__ = [
    "ALL_PARTS",
    "BACKWARD_PARTS",
    "FORWARD_PARTS",
    "KEEP_GRADIENTS",
    "Action",
    "CallPlan",
    "HostCopyBackend",
    "OffloadBackend",
    "OffloadManager",
    "Offloadable",
    "Part",
    "Phase",
    "PlanStep",
    "ResidencyError",
    "ResidencyLedger",
    "ResidencyPlanner",
    "Role",
    "StorageAliasError",
    "TorchMemorySaverBackend",
    "Transition",
    "Work",
    "__version__",
    "check_gradient_isolation",
    "phase_parts",
    "plan_transitions",
]
