"""Ray shells around the trainer workers: one Ray actor per data-parallel rank.

A :class:`TrainGroup` owns a real boundary (one process per rank, placed on a bundle of
the shared placement group): the actor's rank ``r`` and the critic's rank ``r`` run on
the SAME bundle (same device), each asking for a fraction of it. The group shards a
batch over its ranks, calls one method on every rank and gathers the results. It
decides nothing: when to sleep, wake, save or refit is the pump's plan.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

__all__ = ["Op", "Recall", "TrainGroup", "free_port", "shard_rows"]

_WORKER_ENV = {
    # One compute thread per worker process: actor, critic and engines share few cores.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Large CPU tensors on transparent huge pages: far fewer page faults when a model
    # wakes up into freshly allocated memory (host-copy offload on a CPU "device").
    "THP_MEM_ALLOC_ENABLE": "1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shard_rows(rows: int, world_size: int) -> list[slice]:
    """Contiguous, equal row ranges per rank (``rows`` must divide evenly: alignment)."""
    if rows % world_size:
        raise ValueError(
            f"{rows} samples do not split over {world_size} data-parallel ranks; "
            "the group alignment (ppo_sampler.group_alignment) must make chunks divisible"
        )
    per = rows // world_size
    return [slice(r * per, (r + 1) * per) for r in range(world_size)]


def _slice_tree(value: Any, rows: slice) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows].contiguous()
    if isinstance(value, Mapping):
        return {k: _slice_tree(v, rows) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_slice_tree(v, rows) for v in value)
    return value


@dataclass(frozen=True)
class Recall:
    """An argument that stands for this rank's latest result of ``method``, kept on the
    worker: an op can use what an earlier call computed without a driver round trip
    (each rank gets its own rows, as sharded)."""

    method: str


@dataclass(frozen=True)
class Op:
    """One worker method call inside a fused call (:meth:`TrainGroup.submit`).

    ``label`` and ``phase`` name the call on the step timeline.
    """

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    phase: str = ""


class _Host:
    """The per-rank Ray actor body: builds the trainer worker and forwards calls."""

    def __init__(
        self, worker_cls: type, config: Any, rank: int, world_size: int, init: str | None
    ) -> None:
        torch.set_num_threads(1)
        self.worker = worker_cls(config, rank=rank, world_size=world_size, dist_init_method=init)
        self._recent: dict[str, Any] = {}

    def _recall(self, value: Any) -> Any:
        if not isinstance(value, Recall):
            return value
        if value.method not in self._recent:
            raise ValueError(
                f"Recall({value.method!r}): this rank has no result of {value.method} yet; "
                "run that call first (in this or an earlier call)"
            )
        return self._recent[value.method]

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def run(self, ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]], *after: Any) -> Any:
        """Several calls in one Ray round trip, in order: ``[(result, t0, t1)]`` with
        wall-clock times. ``after``: object refs Ray resolves first (ordering only)."""
        del after
        out = []
        for method, args, kwargs in ops:
            t0 = time.time()
            result = getattr(self.worker, method)(
                *[self._recall(a) for a in args],
                **{k: self._recall(v) for k, v in kwargs.items()},
            )
            self._recent[method] = result
            out.append((result, t0, time.time()))
        return out

    def attr(self, name: str) -> Any:
        return getattr(self.worker, name)

    def export_weights(self) -> Any:
        """Used by the rollout refitter through ``__ray_call__`` on rank 0."""
        return self.worker.export_weights()


class TrainGroup:
    """The ranks of one model (``role`` is ``"actor"`` or ``"critic"``)."""

    def __init__(
        self,
        role: str,
        worker_cls: type,
        config: Any,
        *,
        slots: Sequence[Any],
    ) -> None:
        """``slots``: the role's ``ppo_placement`` view, one slot per rank (its
        ``actor_options()`` give the GPU/CPU share and the bundle)."""
        self.role = role
        self.world_size = len(slots)
        init = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else None
        remote_cls = ray.remote(_Host)
        self.handles: list[Any] = [
            remote_cls.options(
                **slot.actor_options(),
                runtime_env={"env_vars": dict(_WORKER_ENV)},
                max_concurrency=1,
            ).remote(worker_cls, config, rank, self.world_size, init)
            for rank, slot in enumerate(slots)
        ]

    def ready(self) -> None:
        """Block until every rank has built its worker (surfaces construction errors)."""
        ray.get([h.attr.remote("is_asleep") for h in self.handles])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every rank; results in rank order."""
        return list(ray.get([h.call.remote(method, args, kwargs) for h in self.handles]))

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.handles[0].call.remote(method, args, kwargs))

    def call_sharded(
        self, method: str, batch: Mapping[str, torch.Tensor], **per_sample: Any
    ) -> list[Any]:
        """Shard ``batch`` and every tensor (or dict of tensors) in ``per_sample`` by rows;
        one call per rank, results in rank order."""
        rows = int(next(iter(batch.values())).shape[0])
        per_rank = self.results(self.submit([Op(method, (batch,), per_sample)], rows=rows))
        return [ops[0][0] for ops in per_rank]

    def submit(
        self, ops: Sequence[Op], *, rows: int | None = None, after: Sequence[Any] = ()
    ) -> list[Any]:
        """Start ``ops`` on every rank as ONE Ray call each; returns the refs (rank order).

        ``rows``: shard every tensor in the ops' arguments by rows (``[B, ...]`` with
        ``B == rows``), contiguous equal ranges per rank. ``after``: refs of another group's
        call (one per rank, or any number) that must finish before these ops start:
        rank ``r`` waits for ``after[r]`` when the counts match, else for all of them.
        """
        shards = shard_rows(rows, self.world_size) if rows is not None else None
        refs = []
        for r, handle in enumerate(self.handles):
            wire = [
                (
                    op.method,
                    _slice_tree(op.args, shards[r]) if shards else op.args,
                    _slice_tree(op.kwargs, shards[r]) if shards else op.kwargs,
                )
                for op in ops
            ]
            deps = [after[r]] if len(after) == self.world_size else list(after)
            refs.append(handle.run.remote(wire, *deps))
        return refs

    @staticmethod
    def results(refs: Sequence[Any]) -> list[list[tuple[Any, float, float]]]:
        """Wait for :meth:`submit` refs: per rank, ``(result, t0, t1)`` for each op."""
        return list(ray.get(list(refs)))

    def is_asleep(self) -> bool:
        return bool(ray.get(self.handles[0].attr.remote("is_asleep")))

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle)
        self.handles = []
