"""What a Ray start leaves on this machine: its session directories and the raylet's own
error lines in them, and the processes to kill and reap after a failed start or a
shutdown (Linux ``/proc``; elsewhere nothing is reaped beyond what Ray does).

Ray 2.60 has no public handle on the processes a ``ray.init`` started: the Popen objects
live on its private ``ray._private.node.Node`` (``all_processes``). Each use of it below
says why the public calls do not serve.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "cleanup_failed_attempt",
    "processes_of",
    "raylet_reason",
    "reap",
    "seconds_since_boot",
    "session_dirs",
]

_RAYLET_LINE = re.compile(r"^\[[^\]]* (?P<level>[A-Z]) \d+ \d+\]")
_REASON_HINTS = ("Timed out", "timed out", "Check failed", "Failed to", "FATAL")


def _ray_temp_root() -> str:
    base = os.environ.get("RAY_TMPDIR") or (
        os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None
    )
    return os.path.join(base or "/tmp", "ray")


def session_dirs() -> set[str]:
    """Session directories this process created (Ray names them ``session_<date>_<pid>``)."""
    return set(glob.glob(os.path.join(_ray_temp_root(), f"session_*_{os.getpid()}")))


def raylet_reason(sessions: list[str], *, max_lines: int = 6) -> str:
    """The raylet's own error lines (``raylet.out``, then ``raylet.err``) of the sessions."""
    quoted: list[str] = []
    for session in sessions:
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


def seconds_since_boot() -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return float("inf")  # not Linux: no cleanup of leftovers


def cleanup_failed_attempt(exc: BaseException, since_boot_s: float) -> None:
    """Stop what a failed ``ray.init`` left running (GCS, raylet, reaper, ...)."""
    import ray
    from ray._private.node import Node

    ray.shutdown()
    # ray.init dropped its half-built Node; its frame in the traceback still holds it,
    # and with it the Popen handles, so Ray itself can kill and reap the processes.
    # Private hook (Ray 2.60, ray._private.node.Node): after a failed start nothing
    # public reaches those processes (ray.shutdown() knows only a node that finished
    # starting), so they would run on, holding ports and memory, until this process exits.
    tb = exc.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            processes = processes_of([node])
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            reap(processes)
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


def processes_of(nodes: list[Any]) -> list[subprocess.Popen[bytes]]:
    """The Popen handles of the processes Ray started for these nodes.

    Private hook (Ray 2.60, ``Node.all_processes``): the only handle on them. The public
    ``ray.shutdown(wait_for_processes=True)`` waits at most 30 s per process and then
    abandons it (its Popen is garbage-collected while the process runs: a
    ResourceWarning, an error under the tests' warnings policy), and does not cover the
    nodes of ``ray.cluster_utils.Cluster``.
    """
    found: list[subprocess.Popen[bytes]] = []
    for node in nodes:
        if node is None:
            continue
        for infos in list(getattr(node, "all_processes", {}).values()):
            found += [info.process for info in infos if info.process is not None]
    return found


def reap(processes: list[subprocess.Popen[bytes]], *, timeout_s: float = 30.0) -> None:
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
