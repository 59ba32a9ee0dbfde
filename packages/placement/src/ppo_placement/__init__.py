"""ppo_placement: shared actor/critic GPU placement on Ray, and the project's local Ray start
(or joining an existing cluster).

``placement_layout``, ``check_streaming_layout`` and ``parse_cluster_address`` are pure
(importing this package does not import Ray); ``SharedPlacement``, ``start_local_ray``
and ``join_ray`` import Ray when called.
"""

from ppo_placement._layout import (
    Layout,
    LayoutError,
    LayoutProblem,
    check_streaming_layout,
    layout_problems,
    placement_layout,
    streaming_layout_problems,
)
from ppo_placement._placement import Bundle, RoleView, SharedPlacement, Slot
from ppo_placement._ray_env import apply_local_ray_env
from ppo_placement._ray_join import (
    RayJoinError,
    cluster_address_problem,
    join_ray,
    parse_cluster_address,
)
from ppo_placement._ray_start import (
    LocalRay,
    RayStartError,
    local_worker_env,
    shutdown_local_ray,
    start_local_ray,
)

__version__ = "0.3.0"

__all__ = [
    "Bundle",
    "Layout",
    "LayoutError",
    "LayoutProblem",
    "LocalRay",
    "RayJoinError",
    "RayStartError",
    "RoleView",
    "SharedPlacement",
    "Slot",
    "__version__",
    "apply_local_ray_env",
    "check_streaming_layout",
    "cluster_address_problem",
    "join_ray",
    "layout_problems",
    "local_worker_env",
    "parse_cluster_address",
    "placement_layout",
    "shutdown_local_ray",
    "start_local_ray",
    "streaming_layout_problems",
]
