"""Benchmark: how long ``start_local_ray`` takes, cold and warm, and a placement group.

Run: ``uv run --frozen python bench/bench_placement.py [--cold 1] [--warm 1]``.

* cold: a fresh interpreter per run (``import ray`` + ``start_local_ray(num_gpus=4)``,
  then shutdown), as a test module or ``ppo-driver train`` pays it;
* warm: start -> shutdown -> start again in one process (Ray already imported, its
  files in the page cache);
* then, on a warm cluster, ``SharedPlacement.create()`` for 4 bundles (reservation plus
  one probe task per bundle) and ``teardown()``.

Reports median and max seconds, plus the ratios warm / cold and placement / warm start.
On the shared 2-core machine the numbers move with the load average, printed alongside;
``attempts`` > 1 means the raylet aborted a start (its agent missed the 30 s port-file
window) and ``start_local_ray`` retried: the time includes the failed attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_COLD = r"""
import json, time
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
from ppo_placement import shutdown_local_ray, start_local_ray
info = start_local_ray(num_cpus=4, num_gpus=4, log_to_driver=False)
t2 = time.perf_counter()
shutdown_local_ray()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "start_s": t2 - t1, "attempts": info.attempts,
                  "shutdown_s": t3 - t2}))
"""


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _row(name: str, values: list[float], note: str = "") -> None:
    print(
        f"{name:<34} {statistics.median(values):>8.2f} {max(values):>8.2f} {len(values):>3}  {note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=1, help="fresh-process starts")
    parser.add_argument("--warm", type=int, default=1, help="in-process restarts")
    args = parser.parse_args()

    print(f"load average at start: {_load()}  (cores: {os.cpu_count()})")
    cold_import, cold_start, cold_shutdown, cold_attempts = [], [], [], []
    for _ in range(args.cold):
        out = subprocess.run(
            [sys.executable, "-c", _COLD], capture_output=True, text=True, check=True
        )
        record = json.loads(out.stdout.strip().splitlines()[-1])
        cold_import.append(record["import_s"])
        cold_start.append(record["start_s"])
        cold_shutdown.append(record["shutdown_s"])
        cold_attempts.append(record["attempts"])

    from ppo_placement import (
        SharedPlacement,
        placement_layout,
        shutdown_local_ray,
        start_local_ray,
    )

    warm_start, warm_shutdown, attempts = [], [], []
    start_local_ray(num_cpus=4, num_gpus=4, log_to_driver=False)  # first: not timed
    for _ in range(args.warm):
        t0 = time.perf_counter()
        shutdown_local_ray()
        t1 = time.perf_counter()
        info = start_local_ray(num_cpus=4, num_gpus=4, log_to_driver=False)
        warm_shutdown.append(t1 - t0)
        warm_start.append(time.perf_counter() - t1)
        attempts.append(info.attempts)

    layout = placement_layout(actor_gpus=2, rollout_gpus=2)
    placement = SharedPlacement(layout)
    t0 = time.perf_counter()
    placement.create()
    create_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    placement.teardown()
    teardown_s = time.perf_counter() - t0
    shutdown_local_ray()

    print()
    print(f"{'seconds':<34} {'median':>8} {'max':>8} {'n':>3}")
    _row("cold: import ray", cold_import)
    _row("cold: start_local_ray(num_gpus=4)", cold_start, f"attempts {cold_attempts}")
    _row("cold: shutdown_local_ray", cold_shutdown)
    _row("warm: start_local_ray(num_gpus=4)", warm_start, f"attempts {attempts}")
    _row("warm: shutdown_local_ray", warm_shutdown)
    _row("SharedPlacement.create (4 bundles)", [create_s])
    _row("SharedPlacement.teardown", [teardown_s])
    print()
    cold, warm = statistics.median(cold_start), statistics.median(warm_start)
    print(f"ratio warm / cold start:          {warm / cold:.2f}")
    print(f"ratio placement create / warm:    {create_s / warm:.2f}")
    print(f"load average at end: {_load()}")


if __name__ == "__main__":
    main()
