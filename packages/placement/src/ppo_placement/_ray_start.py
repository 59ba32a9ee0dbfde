"""Start and stop the project's local Ray cluster, or join an existing one: the one place
that calls ``ray.init``.

On a small, busy machine a cold ``ray.init()`` can fail with "The current node timed
out during startup": the raylet waits a fixed 30 s (Ray 2.60) for its dashboard agent to
write ``metrics_agent_port_*`` and aborts when the agent's start-up is slower (raylet.out:
"Check failed: ... Timed out waiting for file .../metrics_agent_port_..."); Ray's Python
side then waits its own fixed 30 s and reports only the generic message. Neither wait
reads a ``RAY_*`` setting in 2.60 (checked: ``RAY_agent_register_timeout_ms=120000`` does
not stop a 40 s-slow agent from failing the start). :func:`start_local_ray` therefore

* binds every Ray process to the loopback interface (127.0.0.1), keeps the dashboard and
  usage stats off, turns off Ray's ``uv run`` worker wrapping, and raises the timeouts
  Ray does read from ``RAY_*`` variables (only where the caller has not set them);
* byte-compiles / warms the agents' imports when they look cold, and again before a retry;
* retries a failed start (after killing and reaping what the failed attempt left);
* and, when every attempt failed, raises :class:`RayStartError` quoting the raylet's
  own error lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import ipaddress
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "LocalRay",
    "RayJoinError",
    "RayStartError",
    "apply_local_ray_env",
    "cluster_address_problem",
    "join_ray",
    "parse_cluster_address",
    "shutdown_local_ray",
    "start_local_ray",
]

_log = logging.getLogger(__name__)

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

#: Modules the raylet's two Python agents import at start-up.
_AGENT_MODULES = ("ray.dashboard.agent", "ray._private.runtime_env.agent.main")

_RAYLET_LINE = re.compile(r"^\[[^\]]* (?P<level>[A-Z]) \d+ \d+\]")
_REASON_HINTS = ("Timed out", "timed out", "Check failed", "Failed to", "FATAL")

_warmed = False
#: The multi-node cluster started by start_local_ray(nodes > 1), if any.
_cluster: Any = None


@dataclasses.dataclass(frozen=True)
class LocalRay:
    """What :func:`start_local_ray` started (or found already running).

    Attributes:
        address: GCS address (``"127.0.0.1:port"``) other processes can join with.
        session_dir: the session directory (its ``logs/`` holds ``raylet.out``).
        node_ip: the node's IP address as Ray reports it (``127.0.0.1`` when started here).
        started: ``False`` when Ray was already initialised and was reused as is.
        attempts: how many ``ray.init`` calls it took (0 when reused).
        startup_s: wall-clock seconds spent in this call.
    """

    address: str
    session_dir: str
    node_ip: str
    started: bool
    attempts: int
    startup_s: float


class RayStartError(RuntimeError):
    """Every attempt to start the local Ray cluster failed.

    ``reasons`` holds, per attempt, the exception text followed by the raylet's own
    error lines from that attempt's ``raylet.out`` (when it got that far).
    """

    def __init__(self, message: str, *, reasons: tuple[str, ...]) -> None:
        super().__init__(message)
        self.reasons = reasons


def start_local_ray(
    *,
    num_cpus: int | None = None,
    num_gpus: int = 0,
    resources: Mapping[str, float] | None = None,
    object_store_memory: int | None = 512 * 1024 * 1024,
    log_to_driver: bool = True,
    namespace: str | None = None,
    attempts: int = 3,
    warm_imports: bool | None = None,
    nodes: int = 1,
) -> LocalRay:
    """Start a fresh local Ray cluster bound to 127.0.0.1, or reuse the one already up.

    Always starts a NEW cluster (``address="local"``), never attaches to another
    process's cluster found on the machine. If this process already initialised Ray
    (by an earlier call or otherwise), that cluster is reused and nothing is started;
    a :class:`ValueError` is raised when it has fewer nodes than ``nodes`` or a node
    with fewer GPUs than ``num_gpus``.

    Args:
        num_cpus: logical CPUs of the node. ``None``: the machine's core count, but at
            least ``num_gpus`` so that the default placement bundle ``{"GPU": 1,
            "CPU": 1}`` fits once per GPU.
        num_gpus: logical GPUs of the node (may exceed the physical ones on a CPU
            machine: Ray then only does the bookkeeping, e.g. ``ray.get_gpu_ids()``).
        resources: extra custom resources of the node.
        object_store_memory: bytes of the shared-memory object store (``None``: Ray's
            default, 30% of RAM).
        log_to_driver: stream the workers' stdout/stderr to this process.
        namespace: Ray namespace for named actors.
        attempts: ``ray.init`` attempts before giving up (>= 1).
        warm_imports: import the raylet agents' modules in a throw-away interpreter
            before the first attempt (byte-compiles them and fills the page cache).
            ``None``: only when their byte code is missing. Always done before a retry.
        nodes: Ray nodes to start on this machine (``ray.cluster_utils.Cluster``), each
            with ``num_cpus`` / ``num_gpus`` / ``resources``; all share 127.0.0.1 and
            logical GPU ids restart at 0 on every node. For multi-node tests.

    Returns:
        A :class:`LocalRay` record (address, session directory, timing).

    Raises:
        ValueError: a bad argument, or a running cluster too small for the request.
        RayStartError: every attempt failed; the message quotes the raylet's reason.
    """
    t_start = time.perf_counter()
    if num_gpus < 0:
        raise ValueError(f"num_gpus={num_gpus} must be >= 0")
    if num_cpus is not None and num_cpus < 1:
        raise ValueError(f"num_cpus={num_cpus} must be >= 1 (or None for the core count)")
    if attempts < 1:
        raise ValueError(f"attempts={attempts} must be >= 1")
    if nodes < 1:
        raise ValueError(f"nodes={nodes} must be >= 1")

    # Before importing Ray: it reads some of these variables once, at import.
    apply_local_ray_env()
    import ray  # lazily, so that the pure layout functions never need Ray

    if ray.is_initialized():
        return _reuse_running(num_gpus=num_gpus, nodes=nodes, t_start=t_start)

    if num_cpus is None:
        num_cpus = max(os.cpu_count() or 1, num_gpus)
    if warm_imports is None:
        warm_imports = not _agents_compiled()
    if warm_imports:
        _warm_agent_imports()

    reasons: list[str] = []
    for attempt in range(1, attempts + 1):
        before = _session_dirs()
        t_attempt_boot = _seconds_since_boot()
        try:
            if nodes == 1:
                ray.init(
                    address="local",
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    resources=dict(resources) if resources else None,
                    object_store_memory=object_store_memory,
                    include_dashboard=False,
                    log_to_driver=log_to_driver,
                    namespace=namespace,
                    _node_ip_address="127.0.0.1",
                )
            else:
                _start_cluster(
                    nodes=nodes,
                    node_args={
                        "num_cpus": num_cpus,
                        "num_gpus": num_gpus,
                        "resources": dict(resources) if resources else None,
                        "object_store_memory": object_store_memory,
                        "include_dashboard": False,
                    },
                    log_to_driver=log_to_driver,
                    namespace=namespace,
                )
        except Exception as exc:  # Ray raises a bare Exception on start-up timeouts
            reason = f"attempt {attempt}: {type(exc).__name__}: {exc}"
            raylet = _raylet_reason(sorted(_session_dirs() - before))
            if raylet:
                reason += f"\n  raylet.out says:\n{raylet}"
            reasons.append(reason)
            _log.warning("Ray start failed (%s)", reason)
            _cleanup_failed_attempt(exc, t_attempt_boot)
            if attempt < attempts:
                _warm_agent_imports(force=True)
                time.sleep(1.0)
            continue
        return _describe(started=True, attempts=attempt, t_start=t_start)

    raise RayStartError(
        f"could not start a local Ray cluster in {attempts} attempt(s) "
        f"({time.perf_counter() - t_start:.0f} s). Reasons:\n" + "\n".join(reasons),
        reasons=tuple(reasons),
    )


def shutdown_local_ray() -> None:
    """Disconnect from and stop the local Ray cluster; a no-op when Ray is not running."""
    global _cluster
    if "ray" not in sys.modules and _cluster is None:
        return  # Ray never imported: nothing can be running
    import ray

    nodes = [ray._private.worker._global_node]
    if _cluster is not None:
        nodes += [_cluster.head_node, *_cluster.worker_nodes]
    processes = _processes_of(nodes)
    if ray.is_initialized():
        ray.shutdown()
    if _cluster is not None:
        cluster, _cluster = _cluster, None
        cluster.shutdown()
    _reap(processes)


class RayJoinError(RuntimeError):
    """Joining an existing Ray cluster failed: nothing answers at the address, no
    cluster was found for ``auto``, or Ray refused the connection. The message names
    the address and what to do."""


#: A host name or IPv4 address (RFC 1123 labels); IPv6 goes in brackets.
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_ADDRESS_FIX = (
    "use 'auto' (the cluster `ray start` started on this machine) or the head node's GCS "
    "address 'host:port' as `ray start --head --port=PORT` printed it (e.g. 10.0.0.1:6379)"
)
#: The loopback switch apply_local_ray_env forced ("0" in the environment), if it did.
_loopback_forced = False


def parse_cluster_address(address: str) -> tuple[str, int] | None:
    """Check the address of an existing Ray cluster (pure: no Ray, no network).

    Args:
        address: ``"auto"`` (the cluster started on this machine, found by Ray), or the
            head node's GCS address ``"host:port"`` (``"[v6 address]:port"`` for IPv6).

    Returns:
        ``None`` for ``"auto"``, else ``(host, port)``.

    Raises:
        ValueError: what is wrong with ``address`` and the fix (Ray Client addresses,
            ``ray://...``, are refused: the driver needs a Ray node on its machine).
    """
    parsed = _parse_address(address)
    if isinstance(parsed, str):
        raise ValueError(f"cluster address {address!r}{parsed}; {_ADDRESS_FIX}")
    return parsed


def cluster_address_problem(address: object) -> tuple[str, str] | None:
    """What :func:`parse_cluster_address` refuses in ``address``, as ``(what is wrong,
    the fix)``; None when it is accepted (the rule written once, for the driver's validate)."""
    parsed = _parse_address(address)
    if isinstance(parsed, str):
        return parsed.removeprefix(":").strip(), _ADDRESS_FIX
    return None


def _parse_address(address: object) -> tuple[str, int] | str | None:
    """``(host, port)``, None for ``auto``, or why it is refused (a str to follow the address)."""
    if not isinstance(address, str) or not address.strip():
        return " is empty"
    text = address.strip()
    if text == "auto":
        return None
    if "://" in text:
        scheme = text.split("://", 1)[0]
        return (
            f" is a {scheme}:// URL, but the driver joins through the GCS from a machine of "
            "the cluster (not as a Ray Client)"
        )
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        return " has no port"
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            return f": {host} is not an IPv6 address"
        host = inner
    elif not _HOST_NAME.match(host):
        return (
            f": {host!r} is not a host name or IPv4 address (an IPv6 address goes in "
            "brackets, [::1]:6379)"
        )
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        return f": port {port_text!r} is not a number in 1..65535"
    return host, int(port_text)


def join_ray(
    address: str,
    *,
    namespace: str | None = None,
    log_to_driver: bool = True,
    connect_timeout_s: float = 10.0,
) -> LocalRay:
    """Connect this process to an existing Ray cluster; start nothing.

    The cluster was started by someone else (``ray start --head`` on one machine,
    ``ray start --address=HEAD:PORT`` on the others) and this process runs on one of
    its machines. Leaving it (``ray.shutdown()``) only disconnects: the cluster keeps
    running. The project's Ray environment applies (no usage stats, no ``uv run`` worker
    wrapping, longer registration timeouts); the node address is forced to loopback, as
    :func:`start_local_ray` does, only for a loopback ``address`` (a single-machine
    cluster whose nodes were started with ``--node-ip-address=127.0.0.1``): otherwise
    the driver registers with its machine's address, as the cluster's nodes do.

    If this process is already connected to the same cluster (or ``address`` is
    ``"auto"`` and Ray is initialised), that connection is reused.

    Args:
        address: ``"auto"`` or the head node's GCS address ``"host:port"``
            (:func:`parse_cluster_address`).
        namespace: Ray namespace for named actors.
        log_to_driver: stream the workers' stdout/stderr to this process.
        connect_timeout_s: how long the TCP reachability check of ``host:port`` waits
            before ``ray.init`` is even tried.

    Returns:
        A :class:`LocalRay` record with ``started=False``.

    Raises:
        ValueError: a malformed address, or Ray already initialised with another cluster.
        RayJoinError: nothing answers at ``host:port``, no cluster for ``auto``, or
            ``ray.init`` failed; the message says what to check.
    """
    t_start = time.perf_counter()
    target = parse_cluster_address(address)
    if target is not None and _is_loopback(target[0]):
        # A cluster on a loopback address lives on this machine alone: register as
        # 127.0.0.1 like its nodes (Ray would otherwise swap the loopback address for the
        # machine's routable one and miss the cluster).
        apply_local_ray_env()
        _use_local_token()
    else:
        _apply_join_env()
    import ray

    if ray.is_initialized():
        current = str(ray.get_runtime_context().gcs_address)
        if target is None or _same_address(current, target):
            return _describe(started=False, attempts=0, t_start=t_start)
        raise ValueError(
            f"Ray is already initialised in this process with the cluster at {current}, "
            f"not {address}; call ray.shutdown() first"
        )
    if target is not None:
        _check_reachable(address, *target, timeout_s=connect_timeout_s)
    try:
        ray.init(address=address.strip(), log_to_driver=log_to_driver, namespace=namespace)
    except Exception as exc:  # ConnectionError, RuntimeError, or Ray's bare Exception
        with contextlib.suppress(Exception):
            ray.shutdown()
        what = " ".join(str(exc).split()) or type(exc).__name__
        where = address.strip()
        hint = (
            "start one on this machine first (`ray start --head`), or give its address host:port"
            if target is None
            else f"check that the cluster is healthy (`ray status --address={where}`) and "
            f"that this machine is one of its nodes (run `ray start --address={where}` here "
            "first)"
        )
        hint += (
            ". If the cluster uses token authentication (`ray start` turns it on when it "
            "finds a token), set RAY_AUTH_MODE=token and give this process the cluster's "
            "token (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
        )
        raise RayJoinError(
            f"could not join the Ray cluster at {address}: {type(exc).__name__}: {what}; {hint}"
        ) from exc
    return _describe(started=False, attempts=1, t_start=t_start)


def _apply_join_env() -> None:
    """The project's Ray environment for a driver joining a cluster: like
    :func:`apply_local_ray_env` but without the loopback-only switch (undone if that
    function forced it earlier in this process)."""
    global _loopback_forced
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    if _loopback_forced:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        ray_constants.ENABLE_RAY_CLUSTER = not ray_constants.IS_WINDOWS_OR_OSX
        _loopback_forced = False


def _use_local_token() -> None:
    """For a cluster on this machine (loopback address): use this machine's Ray token
    when ``RAY_AUTH_MODE`` is unset and a token exists, as Ray does for ``auto`` (Ray
    never does it for an explicit address, which could be another machine's). Ray
    versions without token authentication: nothing to do."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    with contextlib.suppress(ImportError):
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_reachable(address: str, host: str, port: int, *, timeout_s: float) -> None:
    """A TCP connection to the GCS port, so an unreachable address fails in seconds
    with its reason instead of after Ray's own minute-long retries."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
    raise RayJoinError(
        f"cannot reach the Ray cluster at {address} ({reason}): nothing accepts connections "
        f"on {host}:{port}. Start the cluster first (`ray start --head --port={port}` on the "
        "head machine, `ray start --address=HEAD:PORT` on the others), or fix the address"
    )


def _same_address(current: str, target: tuple[str, int]) -> bool:
    host, _, port = current.rpartition(":")
    return port == str(target[1]) and host.strip("[]") in (target[0], _resolve(target[0]))


def _resolve(host: str) -> str:
    import socket

    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


# --- helpers -----------------------------------------------------------------------


def _reuse_running(*, num_gpus: int, nodes: int, t_start: float) -> LocalRay:
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    have = min((float(n["Resources"].get("GPU", 0.0)) for n in alive), default=0.0)
    if have < num_gpus or len(alive) < nodes:
        raise ValueError(
            f"num_gpus={num_gpus}, nodes={nodes}: Ray is already initialised in this "
            f"process with {len(alive)} node(s) of {have:g} GPU(s); call "
            "shutdown_local_ray() first or ask for no more than that"
        )
    return _describe(started=False, attempts=0, t_start=t_start)


def _start_cluster(
    *, nodes: int, node_args: dict[str, Any], log_to_driver: bool, namespace: str | None
) -> None:
    """Start ``nodes`` Ray nodes on this machine and connect this process to them."""
    global _cluster
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
    try:
        for _ in range(nodes):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=log_to_driver, namespace=namespace)
    except BaseException:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        raise
    _cluster = cluster


def _describe(*, started: bool, attempts: int, t_start: float) -> LocalRay:
    import ray

    ctx = ray.get_runtime_context()
    node = ray._private.worker.global_worker.node
    assert node is not None, "ray.is_initialized() but the worker has no node"
    return LocalRay(
        address=str(ctx.gcs_address),
        session_dir=str(node.get_session_dir_path()),
        node_ip=str(node.node_ip_address),
        started=started,
        attempts=attempts,
        startup_s=time.perf_counter() - t_start,
    )


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

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


def _agents_compiled() -> bool:
    for name in _AGENT_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            return False
        if not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            return False
    return True


def _warm_agent_imports(*, force: bool = False) -> None:
    """Import the agents' modules once in a child interpreter (byte-compiles, warms caches)."""
    global _warmed
    if _warmed and not force:
        return
    code = "import " + ", ".join(_AGENT_MODULES)
    try:
        subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            timeout=300,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        _log.warning("warming Ray's agent imports took over 300 s; starting anyway")
    _warmed = True


def _ray_temp_root() -> str:
    base = os.environ.get("RAY_TMPDIR") or (
        os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None
    )
    return os.path.join(base or "/tmp", "ray")


def _session_dirs() -> set[str]:
    """Session directories this process created (Ray names them ``session_<date>_<pid>``)."""
    return set(glob.glob(os.path.join(_ray_temp_root(), f"session_*_{os.getpid()}")))


def _raylet_reason(session_dirs: list[str], *, max_lines: int = 6) -> str:
    """The raylet's own error lines (``raylet.out``, then ``raylet.err``) of the sessions."""
    quoted: list[str] = []
    for session in session_dirs:
        for name in ("raylet.out", "raylet.err"):
            path = Path(session) / "logs" / name
            if not path.exists():
                continue
            picked = [
                line
                for line in path.read_text(errors="replace").splitlines()
                if ((m := _RAYLET_LINE.match(line)) and m.group("level") in "EFC")
                or any(hint in line for hint in _REASON_HINTS)
            ]
            quoted += [line for line in picked[-max_lines:] if line not in quoted]
    return "\n".join(f"    {line}" for line in quoted)


def _seconds_since_boot() -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return float("inf")  # not Linux: no cleanup of leftovers


def _cleanup_failed_attempt(exc: BaseException, since_boot_s: float) -> None:
    """Stop what a failed ``ray.init`` left running (GCS, raylet, reaper, ...)."""
    import ray
    from ray._private.node import Node

    ray.shutdown()
    # ray.init dropped its half-built Node; its frame in the traceback still holds it,
    # and with it the Popen handles, so Ray itself can kill and reap the processes.
    tb = exc.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            processes = _processes_of([node])
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            _reap(processes)
            break
        tb = tb.tb_next
    # Anything else this attempt started that is still our descendant.
    leftovers = _descendants_started_after(os.getpid(), since_boot_s)
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    # Reap our direct children among them so that no zombies are left behind.
    deadline = time.monotonic() + 5.0
    for pid in leftovers:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
            except ChildProcessError:  # not our child, or already reaped
                break
            time.sleep(0.05)


def _processes_of(nodes: list[Any]) -> list[subprocess.Popen[bytes]]:
    """The Popen handles of the processes Ray started for these nodes."""
    found: list[subprocess.Popen[bytes]] = []
    for node in nodes:
        if node is None:
            continue
        for infos in list(getattr(node, "all_processes", {}).values()):
            found += [info.process for info in infos if info.process is not None]
    return found


def _reap(processes: list[subprocess.Popen[bytes]], *, timeout_s: float = 30.0) -> None:
    """Kill and wait for any of these that Ray's shutdown left running.

    On a loaded machine Ray's own bounded wait can expire; the Popen would then be
    garbage-collected while its process runs (a ResourceWarning, an error in tests).
    """
    deadline = time.monotonic() + timeout_s
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))


def _descendants_started_after(root: int, since_boot_s: float) -> list[int]:
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parent: dict[int, int] = {}
    started: dict[int, float] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        pid = int(stat.split("/")[2])
        parent[pid] = int(fields[1])
        started[pid] = int(fields[19]) / ticks
    found: list[int] = []
    frontier = [root]
    while frontier:
        current = frontier.pop()
        for pid, ppid in parent.items():
            if ppid == current:
                frontier.append(pid)
                if started[pid] >= since_boot_s - 0.5:
                    found.append(pid)
    return found
