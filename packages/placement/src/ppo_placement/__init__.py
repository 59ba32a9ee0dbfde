"""ppo_placement: shared actor/critic GPU placement on Ray, and the project's local Ray start.

``placement_layout`` and ``check_streaming_layout`` are pure (importing this package does
not import Ray); ``SharedPlacement`` and ``start_local_ray`` import Ray when called.
"""

from ppo_placement._layout import Layout, check_streaming_layout, placement_layout
from ppo_placement._placement import Bundle, RoleView, SharedPlacement, Slot
from ppo_placement._ray_start import (
    LocalRay,
    RayStartError,
    apply_local_ray_env,
    shutdown_local_ray,
    start_local_ray,
)

__version__ = "0.1.0"

__all__ = [
    "Bundle",
    "Layout",
    "LocalRay",
    "RayStartError",
    "RoleView",
    "SharedPlacement",
    "Slot",
    "__version__",
    "apply_local_ray_env",
    "check_streaming_layout",
    "placement_layout",
    "shutdown_local_ray",
    "start_local_ray",
]
