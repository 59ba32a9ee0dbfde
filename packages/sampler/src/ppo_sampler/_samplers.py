"""Stateful samplers: which finished groups the next chunk trains on.

Both samplers keep ready groups in buckets keyed by one int (the step for ``in_order``,
the weight version for ``ready_first``), each bucket an insertion-ordered dict. A
``select`` call touches only the eligible buckets and the groups it claims, so its cost
does not grow with the number of groups buffered or ever seen.

Life of a group: ``add`` (ready) -> ``select`` (claimed) -> ``mark_consumed`` (gone);
``release_claim`` puts claimed groups back in front of their bucket; ``ready_first``
with ``evict_stale`` moves too-stale ready groups to an evicted list the driver drains
with ``pop_evicted`` (to re-dispatch their prompts), so no group is silently lost.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Protocol

from ppo_sampler._chunk import _require_int, plan_chunk, plan_fixed_chunk

__all__ = ["GroupId", "InOrderSampler", "ReadyFirstSampler", "Sampler"]

GroupId = int | str
"""A group's identifier: an int or a str, unique over the run (JSON round-trips both)."""

_STATE_FORMAT = 1


class _Buckets:
    """Ready groups in ordered buckets keyed by an int, plus the claimed set.

    Invariants: every live group id is in exactly one of the buckets or ``claimed``;
    ``meta`` holds ``(step, weight_version)`` for every live id; ``keys`` is the sorted
    list of non-empty bucket keys.
    """

    def __init__(self) -> None:
        self.buckets: dict[int, OrderedDict[GroupId, None]] = {}
        self.keys: list[int] = []
        self.meta: dict[GroupId, tuple[int, int]] = {}
        self.claimed: dict[GroupId, None] = {}
        self.num_ready = 0

    def put(self, group_id: GroupId, key: int, *, front: bool = False) -> None:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = OrderedDict()
            bisect.insort(self.keys, key)
        bucket[group_id] = None
        if front:
            bucket.move_to_end(group_id, last=False)
        self.num_ready += 1

    def count(self, key: int) -> int:
        bucket = self.buckets.get(key)
        return 0 if bucket is None else len(bucket)

    def count_at_least(self, low: int) -> int:
        """Ready groups in buckets with key >= low (touches only those buckets)."""
        start = bisect.bisect_left(self.keys, low)
        return sum(len(self.buckets[k]) for k in self.keys[start:])

    def keys_below(self, high: int) -> list[int]:
        return self.keys[: bisect.bisect_left(self.keys, high)]

    def _drop_if_empty(self, key: int) -> None:
        if not self.buckets[key]:
            del self.buckets[key]
            del self.keys[bisect.bisect_left(self.keys, key)]

    def claim_from(self, low: int, n: int) -> list[GroupId]:
        """Claim the first ``n`` ready groups in key order among keys >= low."""
        taken: list[GroupId] = []
        while len(taken) < n:
            key = self.keys[bisect.bisect_left(self.keys, low)]
            bucket = self.buckets[key]
            while bucket and len(taken) < n:
                group_id, _ = bucket.popitem(last=False)
                taken.append(group_id)
            self._drop_if_empty(key)
        self.num_ready -= n
        for group_id in taken:
            self.claimed[group_id] = None
        return taken

    def remove_bucket(self, key: int) -> list[GroupId]:
        ids = list(self.buckets[key])
        del self.buckets[key]
        del self.keys[bisect.bisect_left(self.keys, key)]
        self.num_ready -= len(ids)
        return ids

    def ready_in_order(self) -> Iterator[GroupId]:
        for key in self.keys:
            yield from self.buckets[key]


def _check_ids(
    func: str, ids: Iterable[GroupId], known: dict[GroupId, Any], what: str
) -> list[GroupId]:
    """Materialise ``ids``; every id must be in ``known`` and listed once."""
    out = list(ids)
    seen: set[GroupId] = set()
    for group_id in out:
        if group_id not in known:
            raise ValueError(f"{func}: group {group_id!r} is not {what}; nothing was changed")
        if group_id in seen:
            raise ValueError(f"{func}: group {group_id!r} is listed twice; nothing was changed")
        seen.add(group_id)
    return out


def _check_group_id(func: str, group_id: object) -> GroupId:
    if isinstance(group_id, bool) or not isinstance(group_id, int | str):
        raise ValueError(f"{func}: group_id={group_id!r} must be an int or a str")
    return group_id


class _SamplerBase:
    """Shared bookkeeping; subclasses define eligibility, keys and dispatch bounds."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._b = _Buckets()
        self._evicted: list[GroupId] = []
        self._trainer_step: int | None = None
        self._trainer_version: int | None = None

    # -- subclass hooks ---------------------------------------------------------------
    def _key(self, step: int, weight_version: int) -> int:
        raise NotImplementedError

    def _eligible_count(self, trainer_step: int, trainer_version: int) -> int:
        raise NotImplementedError

    def _claim(self, trainer_step: int, trainer_version: int, n: int) -> list[GroupId]:
        raise NotImplementedError

    def _settings(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- driver API -------------------------------------------------------------------
    def add(self, group_id: GroupId, *, step: int, weight_version: int) -> None:
        """Record that group ``group_id`` (generated for ``step`` with weights
        ``weight_version``) has finished generating; it becomes ready and unclaimed.

        Raises:
            ValueError: if the id is already buffered, claimed or awaiting ``pop_evicted``,
                or ``step``/``weight_version`` is not an int >= 0.
        """
        fn = f"{self.name}.add"
        _check_group_id(fn, group_id)
        _require_int(fn, "step", step, minimum=0, why="the step the group was dispatched for")
        _require_int(fn, "weight_version", weight_version, minimum=0, why="policy version used")
        if group_id in self._b.meta:
            raise ValueError(
                f"{fn}: group {group_id!r} is already in the sampler; ids must be unique per run"
            )
        self._b.meta[group_id] = (step, weight_version)
        self._b.put(group_id, self._key(step, weight_version))

    def select(
        self,
        *,
        trainer_step: int,
        trainer_version: int,
        remaining: int,
        min_groups: int,
        alignment: int = 1,
    ) -> list[GroupId]:
        """Claim the next chunk of this step: ``plan_chunk`` over the eligible ready groups.

        Args:
            trainer_step: the step being trained.
            trainer_version: the trainer's current policy weight version.
            remaining: groups of this step not yet claimed for training (``> 0``).
            min_groups: the readiness minimum (``async_rl.min_groups_for_streaming_train``).
            alignment: the group alignment (:func:`ppo_sampler.group_alignment`).

        Returns:
            The claimed group ids, oldest first; ``[]`` means wait (deferred groups stay
            ready and unclaimed).
        """
        fn = f"{self.name}.select"
        _require_int(fn, "trainer_step", trainer_step, minimum=0, why="the step being trained")
        _require_int(fn, "trainer_version", trainer_version, minimum=0, why="policy version")
        ready = self._eligible_count(trainer_step, trainer_version)
        # plan first: a bad argument raises before any state changes
        n = self._plan(ready=ready, remaining=remaining, min_groups=min_groups, alignment=alignment)
        self._trainer_step, self._trainer_version = trainer_step, trainer_version
        self._before_select(trainer_version)
        if n == 0:
            return []
        return self._claim(trainer_step, trainer_version, n)

    def _plan(self, *, ready: int, remaining: int, min_groups: int, alignment: int) -> int:
        """The chunk size to claim now (``plan_chunk``; fixed blocks for ``in_order``)."""
        return plan_chunk(
            ready=ready, remaining=remaining, min_groups=min_groups, alignment=alignment
        )

    def _before_select(self, trainer_version: int) -> None:
        """Hook run at the start of ``select`` (eviction for ``ready_first``)."""

    def mark_consumed(self, group_ids: Iterable[GroupId]) -> None:
        """Forget claimed groups once the step's policy and critic updates both finished.

        Raises:
            ValueError: if an id is not claimed or listed twice (nothing is changed).
        """
        ids = _check_ids(f"{self.name}.mark_consumed", group_ids, self._b.claimed, "claimed")
        for group_id in ids:
            del self._b.claimed[group_id]
            del self._b.meta[group_id]

    def release_claim(self, group_ids: Iterable[GroupId]) -> None:
        """Return claimed groups to the front of their buckets, ready and unclaimed,
        in the given order (use after a failed chunk).

        Raises:
            ValueError: if an id is not claimed or listed twice (nothing is changed).
        """
        ids = _check_ids(f"{self.name}.release_claim", group_ids, self._b.claimed, "claimed")
        for group_id in reversed(ids):
            del self._b.claimed[group_id]
            self._b.put(group_id, self._key(*self._b.meta[group_id]), front=True)

    def pop_evicted(self) -> list[GroupId]:
        """Return and forget the ids evicted as stale since the last call (oldest first)."""
        evicted, self._evicted = self._evicted, []
        for group_id in evicted:
            del self._b.meta[group_id]
        return evicted

    def stale(self) -> list[GroupId]:
        """Ready groups too old to be eligible as of the last ``select`` (kept, not claimed)."""
        raise NotImplementedError

    # -- inspection -------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        """Ready (buffered, unclaimed) groups, eligible or not."""
        return self._b.num_ready

    def claimed(self) -> list[GroupId]:
        """Claimed, not yet consumed groups, in claim order."""
        return list(self._b.claimed)

    def info(self, group_id: GroupId) -> tuple[int, int]:
        """``(step, weight_version)`` of a live (ready, claimed or evicted) group."""
        return self._b.meta[group_id]

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot: ready groups in order, claimed, evicted."""

        def rows(ids: Iterable[GroupId]) -> list[list[GroupId | int]]:
            return [[g, *self._b.meta[g]] for g in ids]

        return {
            "format": _STATE_FORMAT,
            "name": self.name,
            "settings": self._settings(),
            "trainer_step": self._trainer_step,
            "trainer_version": self._trainer_version,
            "ready": rows(self._b.ready_in_order()),
            "claimed": rows(self._b.claimed),
            "evicted": rows(self._evicted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this sampler's groups with those of a ``state_dict()`` snapshot.

        The sampler keeps its own settings (a run may resume with a new staleness bound).
        Claimed groups stay claimed; a driver resuming mid-step calls
        ``release_claim(sampler.claimed())``.

        Raises:
            ValueError: if the snapshot is from another sampler or malformed.
        """
        fn = f"{self.name}.load_state_dict"
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{fn}: unknown state format {state.get('format')!r}")
        if state.get("name") != self.name:
            raise ValueError(
                f"{fn}: snapshot is from sampler {state.get('name')!r}, not {self.name!r}; "
                "set async_rl.sampler.name to the sampler the checkpoint was written with"
            )
        buckets = _Buckets()
        evicted: list[GroupId] = []

        def admit(row: object) -> GroupId:
            if not isinstance(row, list | tuple) or len(row) != 3:
                raise ValueError(f"{fn}: malformed group row {row!r}; expected [id, step, version]")
            group_id = _check_group_id(fn, row[0])
            step = _require_int(fn, "step", row[1], minimum=0, why=f"of group {group_id!r}")
            version = _require_int(fn, "weight_version", row[2], minimum=0, why=f"of {group_id!r}")
            if group_id in buckets.meta:
                raise ValueError(f"{fn}: group {group_id!r} appears twice in the snapshot")
            buckets.meta[group_id] = (step, version)
            return group_id

        try:
            for row in state["ready"]:
                group_id = admit(row)
                buckets.put(group_id, self._key(*buckets.meta[group_id]))
            for row in state["claimed"]:
                buckets.claimed[admit(row)] = None
            for row in state["evicted"]:
                evicted.append(admit(row))
            position = {k: state[f"trainer_{k}"] for k in ("step", "version")}
        except (KeyError, TypeError) as err:
            raise ValueError(f"{fn}: malformed snapshot, missing or bad {err!r}") from err
        for key, value in position.items():
            if value is not None:
                _require_int(fn, f"trainer_{key}", value, minimum=0, why="saved trainer position")
        self._b, self._evicted = buckets, evicted
        self._trainer_step, self._trainer_version = position["step"], position["version"]


class InOrderSampler(_SamplerBase):
    """``in_order``: only the current step's ready groups are eligible.

    Groups carry the step they were dispatched for; generation may run at most
    ``max_lookahead_versions`` steps ahead of training (see :meth:`can_dispatch`).

    With ``fixed_chunks=True`` (``async_rl.deterministic_chunks``) chunks are the fixed
    blocks of :func:`ppo_sampler.plan_fixed_chunk`, claimed in the order the groups were
    added, so the caller must ``add`` each step's groups in dispatch order (the order
    they were sent to generation, not the order they finished): then which groups form
    each chunk depends only on that order, never on timing.
    """

    name: ClassVar[str] = "in_order"

    def __init__(self, *, max_lookahead_versions: int = 1, fixed_chunks: bool = False) -> None:
        super().__init__()
        if not isinstance(fixed_chunks, bool):
            raise ValueError(
                f"InOrderSampler: fixed_chunks={fixed_chunks!r} must be a bool "
                "(async_rl.deterministic_chunks)"
            )
        self.fixed_chunks = fixed_chunks
        self.max_lookahead_versions = _require_int(
            "InOrderSampler",
            "max_lookahead_versions",
            max_lookahead_versions,
            minimum=0,
            why="async_rl.sampler.max_lookahead_versions; 0 means no generation ahead",
        )

    def can_dispatch(self, step: int, *, trainer_step: int) -> bool:
        """May prompts for ``step`` be sent to generation while training ``trainer_step``?

        True for ``trainer_step <= step <= trainer_step + max_lookahead_versions``.
        """
        return trainer_step <= step <= trainer_step + self.max_lookahead_versions

    def _key(self, step: int, weight_version: int) -> int:
        return step

    def _eligible_count(self, trainer_step: int, trainer_version: int) -> int:
        return self._b.count(trainer_step)

    def _claim(self, trainer_step: int, trainer_version: int, n: int) -> list[GroupId]:
        return self._b.claim_from(trainer_step, n)

    def _plan(self, *, ready: int, remaining: int, min_groups: int, alignment: int) -> int:
        plan = plan_fixed_chunk if self.fixed_chunks else plan_chunk
        return plan(ready=ready, remaining=remaining, min_groups=min_groups, alignment=alignment)

    def _settings(self) -> dict[str, Any]:
        return {
            "max_lookahead_versions": self.max_lookahead_versions,
            "fixed_chunks": self.fixed_chunks,
        }

    def stale(self) -> list[GroupId]:
        """Ready groups of steps before the last selected ``trainer_step`` (left behind)."""
        if self._trainer_step is None:
            return []
        keys = self._b.keys_below(self._trainer_step)
        return [g for k in keys for g in self._b.buckets[k]]


class ReadyFirstSampler(_SamplerBase):
    """``ready_first``: any ready group at most ``max_staleness_versions`` behind.

    A group is eligible when ``trainer_version - weight_version <= max_staleness_versions``;
    the oldest eligible groups are claimed first. Too-stale groups are reported by
    :meth:`stale` and, only with ``evict_stale=True``, moved out at the next ``select``
    to the list :meth:`pop_evicted` returns.
    """

    name: ClassVar[str] = "ready_first"

    def __init__(self, *, max_staleness_versions: int = 1, evict_stale: bool = False) -> None:
        super().__init__()
        self.max_staleness_versions = _require_int(
            "ReadyFirstSampler",
            "max_staleness_versions",
            max_staleness_versions,
            minimum=0,
            why="async_rl.sampler.max_staleness_versions; 0 means on-policy only",
        )
        if not isinstance(evict_stale, bool):
            raise ValueError(
                f"ReadyFirstSampler: evict_stale={evict_stale!r} must be a bool "
                "(async_rl.sampler.evict_stale)"
            )
        self.evict_stale = evict_stale

    def can_dispatch(self, step: int, *, trainer_step: int) -> bool:
        """May prompts for ``step`` be sent to generation while training ``trainer_step``?

        True for ``trainer_step <= step <= trainer_step + max_staleness_versions``: a
        group generated further ahead could only be trained staler than the bound.
        """
        return trainer_step <= step <= trainer_step + self.max_staleness_versions

    def _oldest_eligible(self, trainer_version: int) -> int:
        return trainer_version - self.max_staleness_versions

    def _key(self, step: int, weight_version: int) -> int:
        return weight_version

    def _before_select(self, trainer_version: int) -> None:
        if self.evict_stale:
            for key in self._b.keys_below(self._oldest_eligible(trainer_version)):
                self._evicted.extend(self._b.remove_bucket(key))

    def _eligible_count(self, trainer_step: int, trainer_version: int) -> int:
        return self._b.count_at_least(self._oldest_eligible(trainer_version))

    def _claim(self, trainer_step: int, trainer_version: int, n: int) -> list[GroupId]:
        return self._b.claim_from(self._oldest_eligible(trainer_version), n)

    def _settings(self) -> dict[str, Any]:
        return {
            "max_staleness_versions": self.max_staleness_versions,
            "evict_stale": self.evict_stale,
        }

    def stale(self) -> list[GroupId]:
        """Ready groups more than ``max_staleness_versions`` behind the last
        ``trainer_version`` passed to ``select`` (only non-empty without eviction)."""
        if self._trainer_version is None:
            return []
        keys = self._b.keys_below(self._oldest_eligible(self._trainer_version))
        return [g for k in keys for g in self._b.buckets[k]]


class Sampler(Protocol):
    """What the driver relies on; both samplers implement it."""

    name: ClassVar[str]

    def can_dispatch(self, step: int, *, trainer_step: int) -> bool: ...
    def add(self, group_id: GroupId, *, step: int, weight_version: int) -> None: ...
    def select(
        self,
        *,
        trainer_step: int,
        trainer_version: int,
        remaining: int,
        min_groups: int,
        alignment: int = 1,
    ) -> list[GroupId]: ...
    def mark_consumed(self, group_ids: Iterable[GroupId]) -> None: ...
    def release_claim(self, group_ids: Iterable[GroupId]) -> None: ...
    def pop_evicted(self) -> list[GroupId]: ...
    def stale(self) -> list[GroupId]: ...
    @property
    def num_ready(self) -> int: ...
    def claimed(self) -> list[GroupId]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
