"""A watcher beside ``ppo-driver train`` on a joined cluster, for the one end the driver
cannot report itself: Ray ends a driver whose node's raylet is gone (a killed head on the
driver's node) at its next object-store call, with ``_Exit(1)`` in C++ ("The connection
to the plasma store is failed. Terminate the process."): no Python runs after it.

The driver holds the write end of a pipe; the watcher (a small process of its own that
imports nothing heavy until needed) reads it. The CLI writes ``done`` once it has
reported the run's end itself. End of file without ``done``, while the cluster's GCS
refuses connections, is such an end: the watcher prints the ``ppo-driver:`` lines the
driver would have printed (the steps done, the lost cluster, the last complete
checkpoint, the ``--resume`` command), notes it in ``train.log``, and removes a
checkpoint's ``.partial`` directory that the lost workers left. Any other end (the
cluster still answers: a signal, a crash drill) gets nothing from it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ppo_driver._latest import last_checkpoint_note

__all__ = ["AbruptEndWatch"]


class AbruptEndWatch:
    """The driver's side: starts the watcher; :meth:`done` before any reported end."""

    def __init__(self, *, address: str, run_dir: Path, resume_command: str) -> None:
        read_end, self._write_end = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ppo_driver._watch", address, str(run_dir), resume_command],
                stdin=read_end,
            )
        finally:
            os.close(read_end)

    def done(self) -> None:
        """The CLI reported the end itself: the watcher exits without a word."""
        if self._write_end >= 0:
            os.write(self._write_end, b"done\n")
            os.close(self._write_end)
            self._write_end = -1


def address_reachable(address: str, timeout_s: float = 5.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s`` (a stopped
    head refuses at once). The one reachability check of the driver and this watcher."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    rows = path.read_text().splitlines() if path.exists() else []
    steps = [int(json.loads(x)["step"]) for x in rows if x.strip()]
    return max(steps) + 1 if steps else 0


def _report(address: str, run_dir: Path, resume_command: str) -> None:
    what = (
        f"the Ray cluster's head ({address}) does not answer: the cluster is gone, and Ray "
        "ended the driver process when its node's object store went away"
    )
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir():
        for partial in ckpt_dir.glob("step_*.partial"):  # the lost workers' half-written one
            shutil.rmtree(partial, ignore_errors=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        with (run_dir / "train.log").open("a") as log:
            log.write(f"{stamp} ppo_driver ERROR stopped: {what} (seen by the watcher)\n")
    except OSError:
        pass
    lines = [
        f"stopped at step {_steps_done(run_dir)}: {what}",
        "the workers and engines went with the cluster; no Python traceback exists (Ray's "
        "own log of the driver is in the cluster's session logs)",
        last_checkpoint_note(run_dir),
        f"to continue: {resume_command}",
    ]
    print("\n".join(f"ppo-driver: {line}" for line in lines), file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    address, run_dir, resume_command = argv
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the driver handles them
        signal.signal(sig, signal.SIG_IGN)
    said = sys.stdin.buffer.read()
    if b"done" not in said and not address_reachable(address):
        _report(address, Path(run_dir), resume_command)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
