"""The Ray process environment of this project's Ray starts and joins (no Ray import at
module level: the pure layout functions never need Ray).

Ray 2.60 reads two of these switches once, when ``ray`` is imported, into module
constants of ``ray._private.ray_constants``; a driver that imported Ray before calling
:func:`apply_local_ray_env` would otherwise keep the import-time values. Those two
constants are the only private hooks here; each carries the reason next to it.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["apply_join_env", "apply_local_ray_env", "use_local_token"]

#: Environment that every local start uses. ``RAY_USAGE_STATS_ENABLED`` and the loopback
#: switch are forced; the timeouts are defaults the caller may override in the environment.
_FORCED_ENV = {
    # Never phone home.
    "RAY_USAGE_STATS_ENABLED": "0",
    # "Single-machine" mode: Ray resolves the node address to 127.0.0.1 instead of the
    # host's routable address, so GCS, raylet, object manager and workers listen on
    # loopback only (Ray reads this once, at import, into ray_constants.ENABLE_RAY_CLUSTER).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Under `uv run`, Ray >= 2.43 would otherwise start every worker through `uv run`
    # inside a zip of the current directory (a runtime_env with py_executable and
    # working_dir): slow, and it re-resolves the environment. The workers use this
    # interpreter (sys.executable), which already has the whole workspace installed.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}
_DEFAULT_ENV = {
    # The raylet's budget for agent registration / runtime-env agent calls (default
    # 30 s). In Ray 2.60 it does NOT cover the 30 s port-file wait that fails start-ups
    # here (that one is fixed); kept for the waits and Ray versions that honour it.
    "RAY_agent_register_timeout_ms": "120000",
    # How long the raylet waits for a started worker process to register (default 60 s);
    # a worker that imports torch on a loaded 2-core machine can need more.
    "RAY_worker_register_timeout_seconds": "180",
}

#: The loopback switch apply_local_ray_env forced ("0" in the environment), if it did.
_loopback_forced = False


def apply_local_ray_env() -> None:
    """Set the project's Ray process environment in this process, starting nothing.

    Loopback-only addresses, usage stats off, no ``uv run`` runtime environment for
    workers, and longer agent / worker registration timeouts (those only where the
    environment does not set them already). :func:`start_local_ray` calls it; call it
    yourself before ``ray.cluster_utils.Cluster`` or a ``ray start`` subprocess.
    Idempotent.
    """
    global _loopback_forced
    _loopback_forced = _loopback_forced or (
        os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        != _FORCED_ENV["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
    )
    os.environ.update(_FORCED_ENV)
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    # Ray copied two of these switches into module constants when it was imported.
    from ray._private import ray_constants

    # Private hook (Ray 2.60, ray_constants.ENABLE_RAY_CLUSTER): the loopback-only node
    # address. Ray has no public setting for it after import. ray.init's
    # ``_node_ip_address`` (underscored too; start_local_ray passes it) covers only the
    # node ray.init starts itself: the nodes of ray.cluster_utils.Cluster
    # (start_local_ray(nodes > 1)) and a `ray start` child resolve their address through
    # ray.util.get_node_ip_address(), which reads this constant.
    ray_constants.ENABLE_RAY_CLUSTER = False
    _no_uv_run_workers()


def apply_join_env() -> None:
    """The project's Ray environment for a driver joining a cluster: like
    :func:`apply_local_ray_env` but without the loopback-only switch (undone if that
    function forced it earlier in this process)."""
    global _loopback_forced
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    _no_uv_run_workers()
    if _loopback_forced:
        from ray._private import ray_constants

        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        # Private hook (Ray 2.60): undo the loopback-only constant set above (see
        # apply_local_ray_env), back to Ray's own import-time default.
        ray_constants.ENABLE_RAY_CLUSTER = not ray_constants.IS_WINDOWS_OR_OSX
        _loopback_forced = False


def _no_uv_run_workers() -> None:
    """Private hook (Ray 2.60, ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV): no
    ``uv run`` wrapping of the workers. Ray reads the variable once, at import, and
    ray.init applies the uv hook whenever the constant is on and the driver runs under
    ``uv run``, whatever ``runtime_env`` is passed (ray.init's ``_skip_env_hook`` skips
    only RAY_RUNTIME_ENV_HOOK): no public argument turns it off after import."""
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


def use_local_token() -> None:
    """For a cluster on this machine (loopback address): use this machine's Ray token
    when ``RAY_AUTH_MODE`` is unset and a token exists, as Ray does for ``auto`` (Ray
    never does it for an explicit address, which could be another machine's). Ray
    versions without token authentication: nothing to do."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    # Private hook (Ray 2.60, ray._private.authentication): Ray's own rule for "a token
    # exists" (~/.ray/auth_token, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH). Ray exposes no
    # public call for it; setting RAY_AUTH_MODE=token ourselves would restate that rule
    # and turn authentication on even when no token exists.
    with contextlib.suppress(ImportError):
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
