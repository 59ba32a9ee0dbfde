"""ppo_placement: shared actor/critic GPU placement on Ray, and the project's local Ray start."""

from ppo_placement._ray_start import (
    LocalRay,
    RayStartError,
    apply_local_ray_env,
    shutdown_local_ray,
    start_local_ray,
)

__version__ = "0.1.0"

__all__ = [
    "LocalRay",
    "RayStartError",
    "__version__",
    "apply_local_ray_env",
    "shutdown_local_ray",
    "start_local_ray",
]
