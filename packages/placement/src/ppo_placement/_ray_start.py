"""Start and stop the project's local Ray cluster. With :mod:`._ray_join` (joining an
existing cluster) the only place that calls ``ray.init``; the environment both use is
:mod:`._ray_env`'s, the clean-up after a failed start :mod:`._ray_processes`'.

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
* starts the cluster's processes with the caller's ``worker_env`` (every worker inherits
  the raylet's environment), so that actors needing those variables can run in the
  workers Ray starts ahead instead of each starting a process of its own;
* runs the workers at the caller's scheduling priority (``worker_niceness`` 0), where
  Ray's own default lowers them by 15 below it;
* byte-compiles / warms the agents' imports when they look cold, and again before a retry;
* retries a failed start (after killing and reaping what the failed attempt left);
* and, when every attempt failed, raises :class:`RayStartError` quoting the raylet's
  own error lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

from ppo_placement._ray_env import apply_local_ray_env
from ppo_placement._ray_processes import (
    cleanup_failed_attempt,
    processes_of,
    raylet_reason,
    reap,
    seconds_since_boot,
    session_dirs,
)

__all__ = [
    "LocalRay",
    "RayStartError",
    "describe",
    "local_worker_env",
    "shutdown_local_ray",
    "start_local_ray",
]

_log = logging.getLogger(__name__)

#: Modules the raylet's two Python agents import at start-up.
_AGENT_MODULES = ("ray.dashboard.agent", "ray._private.runtime_env.agent.main")

_warmed = False
#: The multi-node cluster started by start_local_ray(nodes > 1), if any.
_cluster: Any = None
#: (session name, worker_env) of the cluster start_local_ray last started.
_started_env: tuple[str, dict[str, str]] | None = None


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
        worker_env: the variables every process of the cluster was started with
            (``start_local_ray``'s ``worker_env``; empty for a cluster started
            elsewhere).
    """

    address: str
    session_dir: str
    node_ip: str
    started: bool
    attempts: int
    startup_s: float
    worker_env: Mapping[str, str] = dataclasses.field(default_factory=dict)


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
    idle_workers: bool = False,
    worker_env: Mapping[str, str] | None = None,
    worker_niceness: int | None = 0,
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
        idle_workers: keep Ray's idle Python workers (its default): every worker whose
            task is done waits in a pool for the next task, up to ``num_cpus`` of them.
            ``False`` (the default here): a worker idle for a second exits
            (``num_workers_soft_limit`` 0). An actor never takes a worker that ran a task,
            so on the driver's runs (actors only, after one placement probe per bundle,
            which the workers Ray starts as the driver connects serve) the pool only
            idled: 1 % of a core per worker for the whole run. Without it a task after
            an idle second waits for a new worker (about 0.5 s).
        worker_env: environment variables of every process the cluster starts (its
            workers inherit them from the raylet); this process's own environment is
            left as it was. Unlike an actor's ``runtime_env={"env_vars": ...}`` (whose
            actor Ray starts a process of its own for), the workers Ray starts ahead
            of time (one per CPU as the driver connects) carry them too, so an actor
            created soon after (within the idle second above) takes one of those.
            Ignored when the cluster was already running: :func:`local_worker_env`
            says what that one has.
        worker_niceness: how much lower (``nice`` increments, 0 to 19) the workers'
            scheduling priority is than this process's (the raylet's ``worker_niceness``,
            applied to every node). 0 (the default here): the workers run at the
            priority the caller runs at, as a single-process trainer would; ``nice -n
            10 <caller>`` then lowers them all. ``None``: Ray's default, 15 (its daemons
            keep the caller's priority). At 15 a worker sharing a core with a process
            of normal priority gets about 3 % of it, so on a machine where anything
            else runs, the training ranks and engines yield to it (the driver's
            built-in task beside a busy loop on a 2-core machine: about 10 % more wall
            time a step at 15 than at 0). Ignored when the cluster was already running.

    Returns:
        A :class:`LocalRay` record (address, session directory, timing).

    Raises:
        ValueError: a bad argument, or a running cluster too small for the request.
        RayStartError: every attempt failed; the message quotes the raylet's reason.
    """
    t_start = time.perf_counter()
    _check_start_args(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        attempts=attempts,
        nodes=nodes,
        worker_niceness=worker_niceness,
    )
    # Before importing Ray: it reads some of these variables once, at import.
    apply_local_ray_env()
    import ray  # lazily, so that the pure layout functions never need Ray

    if ray.is_initialized():
        return _reuse_running(num_gpus=num_gpus, nodes=nodes, t_start=t_start)
    node_args = _node_args(num_cpus, num_gpus, resources, object_store_memory)
    system_config: dict[str, int] = {}  # the head node's, for the whole cluster
    if not idle_workers:
        system_config["num_workers_soft_limit"] = 0
    if worker_niceness is not None:
        system_config["worker_niceness"] = worker_niceness
    if system_config:
        node_args["_system_config"] = system_config
    _warm_if_cold(warm_imports)
    env = dict(worker_env or {})
    start = partial(_start_ray, nodes, node_args, log_to_driver, namespace, env)
    return _start_with_retries(start, attempts=attempts, t_start=t_start)


def _check_start_args(
    *, num_cpus: int | None, num_gpus: int, attempts: int, nodes: int, worker_niceness: int | None
) -> None:
    if num_gpus < 0:
        raise ValueError(f"num_gpus={num_gpus} must be >= 0")
    if num_cpus is not None and num_cpus < 1:
        raise ValueError(f"num_cpus={num_cpus} must be >= 1 (or None for the core count)")
    if attempts < 1:
        raise ValueError(f"attempts={attempts} must be >= 1")
    if nodes < 1:
        raise ValueError(f"nodes={nodes} must be >= 1")
    if worker_niceness is not None and (
        isinstance(worker_niceness, bool)
        or not isinstance(worker_niceness, int)
        or not 0 <= worker_niceness <= 19
    ):
        raise ValueError(
            f"worker_niceness={worker_niceness!r} must be an int from 0 to 19 (how much "
            "lower than this process the workers run; raising their priority needs "
            "privileges) or None for Ray's default"
        )


def _node_args(
    num_cpus: int | None,
    num_gpus: int,
    resources: Mapping[str, float] | None,
    object_store_memory: int | None,
) -> dict[str, Any]:
    """What every node started here gets (``ray.init`` / ``Cluster.add_node`` keywords)."""
    return {
        "num_cpus": max(os.cpu_count() or 1, num_gpus) if num_cpus is None else num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(resources) if resources else None,
        "object_store_memory": object_store_memory,
        "include_dashboard": False,
    }


def _warm_if_cold(warm_imports: bool | None) -> None:
    """``warm_imports=None``: warm the agents' imports only when their byte code is missing."""
    if warm_imports is None:
        warm_imports = not _agents_compiled()
    if warm_imports:
        _warm_agent_imports()


def _start_ray(
    nodes: int,
    node_args: dict[str, Any],
    log_to_driver: bool,
    namespace: str | None,
    worker_env: dict[str, str],
) -> None:
    """One attempt: ``ray.init`` of a new one-node cluster, or ``nodes`` nodes, whose
    processes start with ``worker_env`` in their environment."""
    global _started_env
    import ray

    if "_system_config" in node_args:  # ray.init adds this attempt's spill directory to it
        node_args = {**node_args, "_system_config": dict(node_args["_system_config"])}
    with _environment(worker_env):  # the GCS and raylet copy it; workers inherit it
        if nodes == 1:
            ray.init(
                address="local",
                **node_args,
                log_to_driver=log_to_driver,
                namespace=namespace,
                _node_ip_address="127.0.0.1",
            )
        else:
            _start_cluster(
                nodes=nodes, node_args=node_args, log_to_driver=log_to_driver, namespace=namespace
            )
    _started_env = (ray.get_runtime_context().get_session_name(), worker_env)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` for the block, then the variables as they were."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def local_worker_env() -> dict[str, str]:
    """The ``worker_env`` that :func:`start_local_ray` started the cluster this process
    is connected to with; empty when not connected, or connected to a cluster started
    otherwise (``ray.init`` elsewhere, a joined cluster)."""
    import ray

    if _started_env is None or not ray.is_initialized():
        return {}
    session, env = _started_env
    return dict(env) if ray.get_runtime_context().get_session_name() == session else {}


def _start_with_retries(start: Callable[[], None], *, attempts: int, t_start: float) -> LocalRay:
    """Run ``start`` until it succeeds, cleaning up and re-warming between attempts."""
    reasons: list[str] = []
    for attempt in range(1, attempts + 1):
        reason = _attempt(start, attempt)
        if reason is None:
            return describe(started=True, attempts=attempt, t_start=t_start)
        reasons.append(reason)
        if attempt < attempts:
            _warm_agent_imports(force=True)
            time.sleep(1.0)
    raise RayStartError(
        f"could not start a local Ray cluster in {attempts} attempt(s) "
        f"({time.perf_counter() - t_start:.0f} s). Reasons:\n" + "\n".join(reasons),
        reasons=tuple(reasons),
    )


def _attempt(start: Callable[[], None], attempt: int) -> str | None:
    """One start attempt; ``None`` when it succeeded, else why it failed (the exception
    and the raylet's own lines), after stopping what it left running."""
    before = session_dirs()
    t_attempt_boot = seconds_since_boot()
    try:
        start()
    except Exception as exc:  # Ray raises a bare Exception on start-up timeouts
        reason = f"attempt {attempt}: {type(exc).__name__}: {exc}"
        raylet = raylet_reason(sorted(session_dirs() - before))
        if raylet:
            reason += f"\n  raylet.out says:\n{raylet}"
        _log.warning("Ray start failed (%s)", reason)
        cleanup_failed_attempt(exc, t_attempt_boot)
        return reason
    return None


def shutdown_local_ray() -> None:
    """Disconnect from and stop the local Ray cluster; a no-op when Ray is not running."""
    global _cluster, _started_env
    _started_env = None
    if "ray" not in sys.modules and _cluster is None:
        return  # Ray never imported: nothing can be running
    import ray

    # Private hook (Ray 2.60, ray._private.worker._global_node): the node ray.init
    # started, whose processes are reaped below (see processes_of for why the public
    # ray.shutdown(wait_for_processes=True) does not serve).
    nodes = [ray._private.worker._global_node]
    if _cluster is not None:
        nodes += [_cluster.head_node, *_cluster.worker_nodes]
    processes = processes_of(nodes)
    if ray.is_initialized():
        ray.shutdown()
    if _cluster is not None:
        cluster, _cluster = _cluster, None
        cluster.shutdown()
    reap(processes)


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
    return describe(started=False, attempts=0, t_start=t_start)


def _start_cluster(
    *, nodes: int, node_args: dict[str, Any], log_to_driver: bool, namespace: str | None
) -> None:
    """Start ``nodes`` Ray nodes on this machine and connect this process to them."""
    global _cluster
    import ray

    # ray.cluster_utils.Cluster is Ray's DeveloperAPI for several nodes on one machine
    # (Ray 2.60 has no public API for it; ray.init starts one node only).
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
    try:
        head_only = {"_system_config"}  # a node other than the head refuses a system config
        for i in range(nodes):
            cluster.add_node(**{k: v for k, v in node_args.items() if i == 0 or k not in head_only})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=log_to_driver, namespace=namespace)
    except BaseException:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        raise
    _cluster = cluster


def describe(*, started: bool, attempts: int, t_start: float) -> LocalRay:
    """The :class:`LocalRay` record of the cluster this process is connected to."""
    import ray
    import ray.util

    ctx = ray.get_runtime_context()
    return LocalRay(
        address=str(ctx.gcs_address),
        session_dir=os.path.join(ctx.get_temp_dir(), ctx.get_session_name()),
        node_ip=str(ray.util.get_node_ip_address()),  # type: ignore[no-untyped-call]
        started=started,
        attempts=attempts,
        startup_s=time.perf_counter() - t_start,
        worker_env=local_worker_env(),
    )


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
