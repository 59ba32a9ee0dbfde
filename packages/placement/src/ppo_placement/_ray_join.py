"""Join an existing Ray cluster (``ray start`` started it; this process runs on one of its
machines): the address check (pure) and the connection, with a message that says what
to check when it fails. No Ray import at module level."""

from __future__ import annotations

import contextlib
import ipaddress
import re
import time

from ppo_placement._ray_env import apply_join_env, apply_local_ray_env, use_local_token
from ppo_placement._ray_start import LocalRay, describe

__all__ = ["RayJoinError", "cluster_address_problem", "join_ray", "parse_cluster_address"]


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
    _apply_env(target)
    import ray

    if ray.is_initialized():
        return _reuse_connection(address, target, t_start=t_start)
    if target is not None:
        _check_reachable(address, *target, timeout_s=connect_timeout_s)
    try:
        ray.init(address=address.strip(), log_to_driver=log_to_driver, namespace=namespace)
    except Exception as exc:  # ConnectionError, RuntimeError, or Ray's bare Exception
        with contextlib.suppress(Exception):
            ray.shutdown()
        what = " ".join(str(exc).split()) or type(exc).__name__
        raise RayJoinError(
            f"could not join the Ray cluster at {address}: {type(exc).__name__}: {what}; "
            f"{_join_hint(address.strip(), target)}"
        ) from exc
    return describe(started=False, attempts=1, t_start=t_start)


def _reuse_connection(address: str, target: tuple[str, int] | None, *, t_start: float) -> LocalRay:
    """The connection this process already has, when it is to ``target`` (any with
    ``auto``); a ``ValueError`` when it is to another cluster."""
    import ray

    current = str(ray.get_runtime_context().gcs_address)
    if target is None or _same_address(current, target):
        return describe(started=False, attempts=0, t_start=t_start)
    raise ValueError(
        f"Ray is already initialised in this process with the cluster at {current}, "
        f"not {address}; call ray.shutdown() first"
    )


def _apply_env(target: tuple[str, int] | None) -> None:
    """The project's Ray environment for joining ``target`` (``None``: ``auto``)."""
    if target is not None and _is_loopback(target[0]):
        # A cluster on a loopback address lives on this machine alone: register as
        # 127.0.0.1 like its nodes (Ray would otherwise swap the loopback address for the
        # machine's routable one and miss the cluster).
        apply_local_ray_env()
        use_local_token()
    else:
        apply_join_env()


def _join_hint(where: str, target: tuple[str, int] | None) -> str:
    """What to check after ``ray.init`` refused to join the cluster at ``where``."""
    hint = (
        "start one on this machine first (`ray start --head`), or give its address host:port"
        if target is None
        else f"check that the cluster is healthy (`ray status --address={where}`) and "
        f"that this machine is one of its nodes (run `ray start --address={where}` here "
        "first)"
    )
    return hint + (
        ". If the cluster uses token authentication (`ray start` turns it on when it "
        "finds a token), set RAY_AUTH_MODE=token and give this process the cluster's "
        "token (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
    )


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
