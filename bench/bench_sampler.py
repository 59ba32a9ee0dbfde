"""Benchmark: ``select`` on samplers holding 10,000 and 100,000 buffered groups.

Run: ``uv run --frozen python bench/bench_sampler.py`` (or ``uv run nox -s bench -- sampler``).

Prints microseconds per ``select`` call (median over many calls, which resists noise on
a shared machine) for:

* ``in_order``: the current step holds one chunk's worth of ready groups; every other
  buffered group belongs to later steps (generated ahead).
* ``ready_first``: groups spread over 100 weight versions, only the newest two eligible;
  the 98 stale versions stay buffered (no eviction), the worst case for a scan.
* ``wait``: a ``select`` that returns ``[]`` (too few ready groups).

and the ratios 100k / 10k, which stay near 1 because ``select`` touches only eligible
buckets and the groups it claims. A last table runs a long steady state (claim,
consume, add new groups) and shows the per-call time does not grow with groups *seen*.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ppo_sampler import InOrderSampler, ReadyFirstSampler, Sampler

CHUNK = 64
CALLS = 2_000


def _alternating_medians_us(
    calls: list[Callable[[], object]], restores: list[Callable[[object], None]]
) -> list[float]:
    """Median wall time in microseconds of each call, timed in alternating blocks so
    that noise from other processes hits all alike; ``restores`` (untimed) undo a call."""
    times: list[list[int]] = [[] for _ in calls]
    for _ in range(20):
        for call, restore, bucket in zip(calls, restores, times, strict=True):
            for _ in range(CALLS // 20):
                start = time.perf_counter_ns()
                result = call()
                bucket.append(time.perf_counter_ns() - start)
                restore(result)
    return [statistics.median(t) / 1_000 for t in times]


def _in_order(buffered: int) -> tuple[Sampler, Callable[[], object]]:
    sampler = InOrderSampler(max_lookahead_versions=buffered)
    for group_id in range(buffered):
        # step 0 holds CHUNK groups; the rest fill later steps of 1,024 groups each
        step = 0 if group_id < CHUNK else 1 + group_id // 1024
        sampler.add(group_id, step=step, weight_version=0)

    def call() -> object:
        return sampler.select(trainer_step=0, trainer_version=0, remaining=1024, min_groups=32)

    return sampler, call


def _ready_first(buffered: int) -> tuple[Sampler, Callable[[], object]]:
    sampler = ReadyFirstSampler(max_staleness_versions=1)
    versions = 100
    for group_id in range(buffered):
        sampler.add(group_id, step=0, weight_version=group_id % versions)

    def call() -> object:
        return sampler.select(
            trainer_step=0, trainer_version=versions - 1, remaining=CHUNK * 2, min_groups=32
        )

    return sampler, call


def _wait(buffered: int) -> tuple[Sampler, Callable[[], object]]:
    sampler = InOrderSampler(max_lookahead_versions=buffered)
    for group_id in range(buffered):
        sampler.add(group_id, step=0 if group_id < 16 else 1 + group_id // 1024, weight_version=0)

    def call() -> object:
        return sampler.select(trainer_step=0, trainer_version=0, remaining=1024, min_groups=32)

    return sampler, call


def _release(sampler: Sampler) -> Callable[[object], None]:
    def after(result: object) -> None:
        assert isinstance(result, list)
        sampler.release_claim(result)

    return after


def scaling_table() -> None:
    print(f"select() cost vs groups buffered (median of {CALLS:,} calls)")
    print(f"{'case':<12}{'claims':>8}{'10k us':>10}{'100k us':>10}{'ratio':>8}")
    for name, build in (("in_order", _in_order), ("ready_first", _ready_first), ("wait", _wait)):
        built = [build(buffered) for buffered in (10_000, 100_000)]
        claims = {len(call()) for _, call in built}  # type: ignore[arg-type]
        for sampler, _ in built:
            sampler.release_claim(sampler.claimed())
        small, large = _alternating_medians_us(
            [call for _, call in built], [_release(sampler) for sampler, _ in built]
        )
        assert [s.num_ready for s, _ in built] == [10_000, 100_000]
        print(f"{name:<12}{claims.pop():>8}{small:>10.1f}{large:>10.1f}{large / small:>8.2f}")


class _Churn:
    """A ``ready_first`` sampler kept at ``buffered`` groups: each cycle claims a chunk,
    consumes it and adds as many new groups; a new policy version every 10k groups."""

    def __init__(self, buffered: int) -> None:
        self.sampler = ReadyFirstSampler(max_staleness_versions=1)
        self.seen = self.version = 0
        self._add(buffered)

    def _add(self, n: int) -> None:
        for group_id in range(self.seen, self.seen + n):
            self.sampler.add(group_id, step=0, weight_version=self.version)
        if (self.seen + n) // 10_000 != self.seen // 10_000:
            self.version += 1  # older versions go stale and stay buffered (no eviction)
        self.seen += n

    def select(self) -> list[int | str]:
        return self.sampler.select(
            trainer_step=0, trainer_version=self.version, remaining=CHUNK * 2, min_groups=32
        )

    def run_until(self, seen: int) -> None:
        while self.seen < seen:
            chunk = self.select()
            assert len(chunk) == CHUNK * 2
            self.sampler.mark_consumed(chunk)
            self._add(len(chunk))


def steady_state_table() -> None:
    """Same buffered count, very different numbers of groups seen, timed alternately so
    that noise from other processes hits both alike."""
    buffered = 100_000
    print(f"\nsteady state, {buffered:,} buffered: select() vs groups seen")
    runs = []
    for seen in (200_000, 2_000_000):
        churn = _Churn(buffered)
        churn.run_until(seen)
        assert churn.sampler.num_ready == buffered
        runs.append(churn)
    medians = _alternating_medians_us(
        [churn.select for churn in runs], [_release(churn.sampler) for churn in runs]
    )
    print(f"{'groups seen':>12}{'claims':>8}{'select us':>11}")
    for churn, us in zip(runs, medians, strict=True):
        print(f"{churn.seen:>12,}{CHUNK * 2:>8}{us:>11.1f}")
    print(f"ratio {runs[1].seen:,} / {runs[0].seen:,} seen: {medians[1] / medians[0]:.2f}")


if __name__ == "__main__":
    scaling_table()
    steady_state_table()
