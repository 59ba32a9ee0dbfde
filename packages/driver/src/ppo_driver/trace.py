"""Step timeline: phases recorded as Chrome-trace events (Perfetto opens the JSON).

Each phase is a complete event (``"ph": "X"``) on a named track: generation on the
generation tracks (odd steps on their own track, since with lookahead a step's
generation overlaps the previous one), chunks / switches / update / refit / critic on
the training track. Times are microseconds from the start of the run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from ppo_driver._json import JSONValue

__all__ = ["PhaseTimer", "TraceEvent", "TraceRecorder"]

_TRACKS = {"training": 1, "generation": 2, "generation (odd steps)": 3, "driver": 4}


class TraceEvent(TypedDict):
    """One complete event (``"ph": "X"``) of the Chrome trace format; ``ts`` and ``dur``
    in microseconds, ``cat`` the phase, ``tid`` the track, ``args`` (``step``, ...)."""

    name: str
    cat: str
    ph: str
    ts: float
    dur: float
    pid: int
    tid: int
    args: dict[str, JSONValue]


@dataclass
class PhaseTimer:
    """Seconds spent per phase name during one step (summed over repeats)."""

    totals: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds


class TraceRecorder:
    """Collects complete events and writes a Chrome-trace JSON file."""

    def __init__(self, *, origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin
        self.events: list[TraceEvent] = []
        self.step_timer = PhaseTimer()

    def now_us(self) -> float:
        return (time.perf_counter() - self.origin) * 1e6

    def add(
        self,
        name: str,
        *,
        start_s: float,
        end_s: float,
        track: str = "training",
        step: int | None = None,
        args: Mapping[str, JSONValue] | None = None,
        phase: str | None = None,
    ) -> None:
        """Record one phase between two ``time.perf_counter()`` readings."""
        event: TraceEvent = {
            "name": name,
            "cat": phase or name,
            "ph": "X",
            "ts": round((start_s - self.origin) * 1e6, 1),
            "dur": round(max(0.0, end_s - start_s) * 1e6, 1),
            "pid": 1,
            "tid": _TRACKS.get(track, 9),
            "args": dict(args or {}),
        }
        if step is not None:
            event["args"]["step"] = step
        self.events.append(event)
        self.step_timer.add(phase or name, end_s - start_s)

    @contextmanager
    def span(
        self,
        name: str,
        *,
        track: str = "training",
        step: int | None = None,
        phase: str | None = None,
        args: Mapping[str, JSONValue] | None = None,
    ) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(
                name,
                start_s=start,
                end_s=time.perf_counter(),
                track=track,
                step=step,
                args=args,
                phase=phase,
            )

    def take_step_totals(self) -> dict[str, float]:
        totals = self.step_timer.totals
        self.step_timer = PhaseTimer()
        return totals

    def write(self, path: str | Path) -> Path:
        """Write the trace atomically (aside, then rename)."""
        path = Path(path)
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "ppo-driver"}}
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
            for track, tid in _TRACKS.items()
        ]
        doc = {"traceEvents": [*meta, *self.events], "displayTimeUnit": "ms"}
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return path
