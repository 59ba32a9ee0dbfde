"""Ray shells around the trainer workers: one Ray actor per rank, grouped by model.

A :class:`TrainGroup` owns a real boundary (one process per rank, placed on a bundle of
the shared placement group): the actor's rank ``r`` and the critic's rank ``r`` run on
the SAME bundle (same device), each asking for a fraction of it.

A group knows its mesh (``ppo_trainer.Mesh``, reported by each rank once built): rows
are split over the data-parallel ranks only, the tensor/pipeline peers of one
data-parallel rank get the same rows, and each result is taken from one rank per
data-parallel group. A call runs on every rank (collectives such as the weight export
need all of them). The group decides nothing: when to sleep, wake, save or refit is
the plan's (``ppo_driver.pair.TrainPair``), passed into each call as
:class:`CallOptions` (``wake_first`` / ``sleep_after``).

A call names the worker class's method itself, not a string: ``TrainGroup[W].submit``
takes a ``Callable[Concatenate[W, P], R]`` and ``*args: P.args, **kwargs: P.kwargs``,
so the type checker refuses a method the worker class does not have, an argument the
method does not take or one of the wrong type, and types the result as ``R``.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
import torch
from ppo_lifecycle import Action, Part, Transition
from ppo_placement import Slot, local_worker_env
from ppo_trainer import ActorConfig, ActorWorker, CriticConfig, CriticWorker, Mesh, ModelSpec
from torch import Tensor

__all__ = [
    "NOW",
    "PROJECT_LOGGERS",
    "CallOptions",
    "GroupResult",
    "Pending",
    "Rows",
    "TrainGroup",
    "WorkerLost",
    "block_shards",
    "data_parallel_layout",
    "free_port",
    "mini_batch_order",
    "shard_rows",
]

#: The environment of the training ranks' processes (and, in a local cluster the driver
#: starts, of every Ray process: start_local_ray's ``worker_env``).
WORKER_ENV = {
    # One compute thread per worker process: actor, critic and engines share few cores.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Large CPU tensors on transparent huge pages: far fewer page faults when a model
    # wakes up into freshly allocated memory (host-copy offload on a CPU "device").
    "THP_MEM_ALLOC_ENABLE": "1",
}

Timeline = list[tuple[str, float, float]]

W = TypeVar("W", bound=ActorWorker | CriticWorker)
"""The worker class of a group: its methods are what the group's calls may name."""
P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


def shard_rows(rows: int, dp_size: int) -> list[slice]:
    """Contiguous, equal row ranges per data-parallel rank (``rows`` must divide evenly:
    the sampler's group alignment guarantees it)."""
    if rows % dp_size:
        raise ValueError(
            f"{rows} samples do not split over {dp_size} data-parallel ranks; "
            "the group alignment (ppo_sampler.group_alignment) must make chunks divisible"
        )
    per = rows // dp_size
    return [slice(r * per, (r + 1) * per) for r in range(dp_size)]


def block_shards(blocks: Sequence[int], dp_size: int) -> list[Tensor]:
    """The rows of each data-parallel rank when a batch is ``blocks`` (row counts, in row
    order) trained as if each block were its own batch: rank ``r`` gets the ``r``-th
    contiguous share of every block (:func:`shard_rows` of each), in block order. A
    chunk of several fixed blocks then puts on every rank, in the same order, the rows
    one chunk per block would (every block must split evenly, as a chunk of its own
    must)."""
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    start = 0
    for size in blocks:
        for shard, part in zip(shards, shard_rows(size, dp_size), strict=True):
            shard.extend(range(start + part.start, start + part.stop))
        start += size
    return [torch.tensor(shard, dtype=torch.long) for shard in shards]


def mini_batch_order(rows: int, dp_size: int, per_rank: int) -> Tensor:
    """A row order under which the contiguous split of :func:`shard_rows` hands every
    data-parallel rank, as its ``k``-th local mini-batch of ``per_rank`` rows, its slice of
    the ``k``-th global mini-batch (``per_rank * dp_size`` consecutive rows): the ranks
    together train on the same mini-batches as one rank would (Megatron's data sampler
    slices each global batch the same way). The identity for one rank."""
    if rows % dp_size:
        shard_rows(rows, dp_size)  # raises, naming the alignment rule
    block = per_rank * dp_size
    # the global mini-batches as blocks (the last one shorter; it divides: rows and
    # block do), each rank's shares of them in order, the ranks one after the other
    sizes = [min(block, rows - start) for start in range(0, rows, block)]
    return torch.cat(block_shards(sizes, dp_size))


class Rows:
    """A batch's model inputs (``[B, T]`` tensors), put into Ray's object store once per
    data-parallel layout and shared by every call that reads them (the critic's value
    forward and the actor's training call of one chunk ship the tokens once).

    ``blocks``: the row counts of the fixed blocks the batch is made of, in row order
    (none: one block). The ranks get their share of each block (:func:`block_shards`);
    per-sample results come back in the batch's row order all the same."""

    def __init__(self, tensors: Mapping[str, Tensor], *, blocks: Sequence[int] = ()) -> None:
        self.tensors = dict(tensors)
        self.size = int(next(iter(self.tensors.values())).shape[0])
        if blocks and sum(blocks) != self.size:
            raise ValueError(f"blocks {list(blocks)} do not add up to the {self.size} rows")
        self.blocks = tuple(blocks) if len(blocks) > 1 else ()
        self._refs: dict[int, list[ray.ObjectRef[dict[str, Tensor]]]] = {}

    def split(self, dp_size: int) -> Sequence[slice | Tensor]:
        """Each data-parallel rank's rows: contiguous shares, or its share of each block."""
        if self.blocks and dp_size > 1:
            return block_shards(self.blocks, dp_size)
        return shard_rows(self.size, dp_size)

    def order(self, dp_size: int) -> Tensor | None:
        """The batch row of each row of the ranks' results concatenated in data-parallel
        order; None where that is the batch's own order."""
        if self.blocks and dp_size > 1:
            return torch.cat(block_shards(self.blocks, dp_size))
        return None

    def shards(self, dp_size: int) -> list[ray.ObjectRef[dict[str, Tensor]]]:
        if dp_size not in self._refs:
            self._refs[dp_size] = [
                ray.put({k: v[s].contiguous() for k, v in self.tensors.items()})
                for s in self.split(dp_size)
            ]
        return self._refs[dp_size]


@dataclass(frozen=True)
class GroupResult(Generic[R_co]):
    """One call's results: ``values`` one per data-parallel rank (from its first rank),
    in data-parallel order, typed as the worker method returns them; ``timeline``: rank
    0's (label, start, end) wall-clock times of the call's parts (wake-up, the work, the
    sleep)."""

    values: Sequence[R_co]
    timeline: Timeline = field(default_factory=list)
    order: Tensor | None = None  # Rows.order: the batch row of each concatenated row

    def tensor(self: GroupResult[Tensor]) -> Tensor:
        """Per-sample results (``[B_d, ...]`` per rank) back in the batch's row order."""
        out = torch.cat(list(self.values), dim=0)
        if self.order is None:
            return out
        placed = torch.empty_like(out)
        placed[self.order] = out
        return placed

    def summed(self: GroupResult[Mapping[str, float]]) -> dict[str, float]:
        """Per-key sums over the data-parallel ranks (non-finite values are kept)."""
        out: dict[str, float] = {}
        for row in self.values:
            for k, v in row.items():
                if isinstance(v, int | float):
                    out[k] = out.get(k, 0.0) + float(v)
        return out

    def reduced(self: GroupResult[Mapping[str, float]]) -> dict[str, float]:
        """Numbers every rank computed alike (already all-reduced): data-parallel rank 0's."""
        return {k: float(v) for k, v in self.values[0].items()}


PROJECT_LOGGERS = ("ppo_driver", "ppo_trainer", "ppo_lifecycle", "ppo_placement", "ppo_sampler")
"""The loggers whose lines a run's ``train.log`` collects, from the worker processes too."""


class LogFile(logging.FileHandler):
    """``train.log``: a line that cannot be written (a full disk) is dropped with one
    line on stderr, not logging's traceback of the write."""

    def handleError(self, record: logging.LogRecord) -> None:
        print(
            f"ppo-driver: a log line could not be written to {self.baseFilename}: "
            f"{sys.exc_info()[1]}",
            file=sys.stderr,
        )


def log_to_file(path: str, level: str) -> None:
    """In a worker process: the project's loggers append to ``path`` (the run's
    ``train.log``; one write per line, so the processes' lines do not mix) at ``level``,
    tagged with the process id. The run directory must be reachable from the worker's
    node (one machine, or a shared filesystem); elsewhere the lines stay in Ray's logs."""
    try:
        handler = LogFile(path)
    except OSError as exc:
        logging.getLogger("ppo_driver").warning("worker logs stay in Ray's logs: %s", exc)
        return
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(name)s %(levelname)s [pid {os.getpid()}] %(message)s")
    )
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.addHandler(handler)


def error_name(exc: BaseException) -> str:
    """The error's class name, without Ray's task wrapper: a call that was running (or
    queued behind another group's call) when the process died raises a ``RayTaskError``
    whose ``cause`` is the death itself, the ``ActorDiedError`` (as ``describe_fault``
    reads it)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, BaseException):
        return type(exc.cause).__name__
    return type(exc).__name__


class WorkerLost(RuntimeError):
    """A trainer worker's process died (killed, out of memory, its node lost): Ray does
    not restart trainer workers, so the run cannot go on. Names the role, the rank, the
    process id and the node."""

    def __init__(self, role: str, rank: int, pid: int | None, node_ip: str | None, why: str):
        self.role, self.rank, self.pid, self.node_ip = role, rank, pid, node_ip
        where = f"pid {pid} on {node_ip}" if pid is not None else "process not started"
        super().__init__(
            f"the {role} worker (rank {rank}, {where}) died ({why}); Ray does not restart "
            "trainer workers"
        )


@dataclass(frozen=True)
class Pending(Generic[R_co]):
    """A call started on every rank; :meth:`result` waits for it (``refs`` may order
    later calls: see :attr:`CallOptions.after`). ``leaders``: the rank whose result
    stands for each data-parallel rank; ``lost``: the group's way to name a dead rank,
    for the errors ``owns`` says are about one of its ranks."""

    refs: Sequence[ray.ObjectRef[tuple[R_co, Timeline]]]
    leaders: Sequence[int]
    lost: Callable[[ray.exceptions.RayActorError], WorkerLost]
    owns: Callable[[ray.exceptions.RayActorError], bool]
    order: Tensor | None = None  # Rows.order of the call's rows

    def done(self) -> bool:
        """Whether every rank has finished (without waiting)."""
        return not ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)[1]

    def result(self) -> GroupResult[R_co]:
        try:
            per_rank = ray.get(list(self.refs))
        except ray.exceptions.RayActorError as exc:
            if self.owns(exc):
                raise self.lost(exc) from exc
            # another group's rank died: a call this one waited for (CallOptions.after)
            # failed, and Ray hands its error on; the run's fault handler names that rank
            raise
        return GroupResult(
            values=[per_rank[r][0] for r in self.leaders],
            timeline=list(per_rank[0][1]),
            order=self.order,
        )


@dataclass(frozen=True)
class CallOptions:
    """The driver's choice for one group call, which the worker carries out around the
    work: ``wake_first`` (``True``: every part, or the parts to wake) and
    ``sleep_after`` (the parts to put to sleep once the work succeeded): the plan's
    lifecycle choice; ``after``: calls (of this group or another) that must finish
    before this one starts. Ray holds the call back until they have, so the driver need
    not wait for them (a wake-up queued behind the other model's sleep)."""

    wake_first: bool | frozenset[Part] = False
    sleep_after: frozenset[Part] | None = None
    after: Sequence[Pending[object]] = ()

    def lifecycle(self) -> dict[str, bool | frozenset[Part]]:
        """The keyword arguments the worker method gets for them (none when unset)."""
        out: dict[str, bool | frozenset[Part]] = {}
        if self.wake_first is not False:
            out["wake_first"] = self.wake_first
        if self.sleep_after is not None:
            out["sleep_after"] = self.sleep_after
        return out


NOW = CallOptions()
"""No lifecycle transition around the call, nothing to wait for."""


def _preload_build_modules(spec: ModelSpec) -> None:
    """Import the modules that ``build`` needs now, at process start, rather than in
    ``build``:

    * ``torch._dynamo``: every torch optimizer imports it on construction (its methods
      are wrapped by ``torch._disable_dynamo``, which imports it on first call): about
      1.1 CPU-s, once per process;
    * transformers' auto classes for a model directory (the built-in model needs only
      torch, imported already).

    Every rank process starts at once, but the driver builds the models one at a time;
    a process that imported these in ``build`` did it after the previous model was
    built (serialised per model: the critic's optimizer import alone held the start-up
    for 0.9 s on an idle 2-core machine, transformers about 4 s on a busy one). Here the
    imports of all ranks overlap each other and the engines' start-up instead. Nothing
    is allocated: the lifecycle rule that two models never need to fit at once holds."""
    importlib.import_module("torch._dynamo")
    if spec.path is None:
        return
    import transformers

    transformers.AutoModelForCausalLM  # noqa: B018 (the attribute access imports it)
    transformers.AutoModelForTokenClassification  # noqa: B018


def _runtime_env() -> dict[str, Any]:
    """A rank's ``runtime_env`` option: the :data:`WORKER_ENV` variables its process
    would not inherit from the cluster. Empty when the driver started the cluster with
    them: then the rank can take one of the workers Ray starts ahead (an actor with a
    ``runtime_env`` of its own always gets a new process)."""
    have = local_worker_env()
    missing = {k: v for k, v in WORKER_ENV.items() if have.get(k) != v}
    return {"runtime_env": {"env_vars": missing}} if missing else {}


class _Host:
    """The per-rank Ray actor body: builds the trainer worker and forwards calls."""

    def __init__(
        self,
        worker_cls: Callable[..., ActorWorker | CriticWorker],
        config: ActorConfig | CriticConfig,
        rank: int,
        world_size: int,
        log_file: tuple[str, str] | None = None,
    ) -> None:
        torch.set_num_threads(1)
        if log_file is not None:
            log_to_file(*log_file)
        self._build_args = (worker_cls, config, rank, world_size)
        self.worker: ActorWorker | CriticWorker | None = None
        _preload_build_modules(config.model)

    def build(self, init: str | None) -> Mesh:
        """Build the model (a collective across the group's ranks, meeting at ``init``,
        ``tcp://host:port``; None for one rank); returns the mesh."""
        worker_cls, config, rank, world_size = self._build_args
        self.worker = worker_cls(config, rank=rank, world_size=world_size, dist_init_method=init)
        mesh: Mesh = self.worker.mesh()
        return mesh

    def call(
        self,
        method: str,
        rows: dict[str, Tensor] | None,
        per_sample: dict[str, Tensor],
        kwargs: dict[str, object],
        *after: object,
        args: tuple[object, ...] = (),
    ) -> tuple[object, Timeline]:
        """``worker.<method>(rows, *args, **per_sample, **kwargs)``; returns (result,
        timeline).

        ``after``: results of earlier calls (on any process) that Ray resolves before
        this call starts; their values are not used (they only order the calls)."""
        first = () if rows is None else (rows,)
        t0 = time.time()
        result = getattr(self.worker, method)(*first, *args, **per_sample, **kwargs)
        t1 = time.time()
        recorded = getattr(self.worker, "last_timeline", None)
        timeline: Timeline = list(recorded()) if callable(recorded) else []
        if not timeline or timeline[0][1] < t0:  # not recorded by this call
            timeline = [(method, t0, t1)]
        return result, timeline

    def where(self) -> tuple[int, str]:
        """This rank's process id and node address (for messages when it dies)."""
        return os.getpid(), ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]

    def export_weights(self) -> dict[str, Tensor] | None:
        """Used by the rollout refitter through ``__ray_call__`` (a collective: every
        rank of the group calls it; the source rank returns the weights)."""
        if self.worker is None:
            raise RuntimeError("export_weights before build()")
        return self.worker.export_weights()


class TrainGroup(Generic[W]):
    """The ranks of one model (``role`` is ``"actor"`` or ``"critic"``), running
    ``worker_cls`` (``ppo_trainer.ActorWorker`` or ``CriticWorker``).

    Construction starts one process per rank; :meth:`build` builds the models (the
    driver builds one model, puts it to sleep, then builds the other: two full models
    never need to fit at once).

    A call names the worker class's method itself (``group.submit(NOW,
    CriticWorker.compute_values, ...)``), not its name: the type checker then checks
    the method and its arguments against the worker class.
    """

    def __init__(
        self,
        role: str,
        worker_cls: type[W],
        config: ActorConfig | CriticConfig,
        *,
        slots: Sequence[Slot],
        log_file: tuple[str, str] | None = None,
    ) -> None:
        """``slots``: the role's ``ppo_placement`` view, one slot per rank (its
        ``actor_options()`` give the GPU/CPU share and the bundle). ``log_file``:
        ``(path, level)``: the ranks' lines of :data:`PROJECT_LOGGERS` go there."""
        self.role = role
        self.worker_cls = worker_cls
        self.world_size = len(slots)
        self._rendezvous_ip = slots[0].node_ip  # the group's rendezvous: on rank 0's node
        remote_cls = ray.remote(_Host)
        self.handles: list[Any] = [
            remote_cls.options(
                **slot.actor_options(),
                **_runtime_env(),
                max_concurrency=1,
            ).remote(worker_cls, config, rank, self.world_size, log_file)
            for rank, slot in enumerate(slots)
        ]
        self.meshes: list[Mesh] = []
        self.leaders: list[int] = []
        self._dp_of: list[int] = []
        self.processes: list[tuple[int, str]] = []  # (pid, node ip) per rank, once built

    def build(self) -> None:
        """Build every rank's worker (surfaces construction errors) and learn the mesh.

        The rendezvous port is chosen here, just before rank 0 listens on it, not when
        the group was made: in between, the other group's build opens its process
        groups, and each gloo group listens on ports the system picks (Megatron opens
        dozens), so a port chosen earlier could be taken by then ("Address already in
        use", seen once in a Megatron run with two data-parallel ranks)."""
        try:
            self.processes = list(ray.get([h.where.remote() for h in self.handles]))
            init = f"tcp://{self._rendezvous_ip}:{free_port()}" if self.world_size > 1 else None
            self.meshes = list(ray.get([h.build.remote(init) for h in self.handles]))
        except ray.exceptions.RayActorError as exc:
            raise self.lost(exc) from exc
        self._dp_of, self.leaders = data_parallel_layout(self.meshes)

    def owns(self, exc: ray.exceptions.RayActorError) -> bool:
        """Whether ``exc`` is about one of this group's ranks (a call made on a rank's
        handle outside :meth:`submit`, such as the refit's, raises Ray's error as is)."""
        return exc.actor_id in {h._actor_id.hex() for h in self.handles}

    def lost(self, exc: ray.exceptions.RayActorError) -> WorkerLost:
        """``exc`` (a rank's actor died) as a :class:`WorkerLost` naming the rank."""
        ids = [h._actor_id.hex() for h in self.handles]
        rank = ids.index(exc.actor_id) if exc.actor_id in ids else 0
        pid, ip = self.processes[rank] if rank < len(self.processes) else (None, None)
        return WorkerLost(self.role, rank, pid, ip, error_name(exc))

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (``world_size / (tp * pp)``)."""
        if not self.meshes:
            raise RuntimeError(f"{self.role} group: build() first")
        return self.meshes[0].dp_size

    def submit(
        self,
        options: CallOptions,
        method: Callable[Concatenate[W, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Pending[R]:
        """Start ``method(*args, **kwargs)`` of every rank's worker as ONE Ray call each,
        with ``options`` (the plan's lifecycle choice and the calls it waits for)."""
        return self._start(options, method, None, args, dict(kwargs))

    def submit_rows(
        self,
        options: CallOptions,
        method: Callable[Concatenate[W, Mapping[str, Tensor], P], R],
        rows: Rows,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Pending[R]:
        """:meth:`submit` of a method whose first argument is the batch: rank ``r`` gets
        the rows of its data-parallel rank (its tensor/pipeline peers the same ones).
        Every tensor keyword argument is per sample (``[B, ...]``) and split the same
        way: one object per data-parallel shard, read by its tensor / pipeline peers
        alike (critic values reach the actor ranks as Ray object references)."""
        return self._start(options, method, rows, args, dict(kwargs))

    def call(
        self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> GroupResult[R]:
        """:meth:`submit` with no lifecycle choice, and wait."""
        return self._start(NOW, method, None, args, dict(kwargs)).result()

    def transition(self, t: Transition, *, after: Sequence[Pending[object]] = ()) -> Pending[None]:
        """The worker's ``sleep`` or ``wake_up`` of ``t.parts`` as its own call."""
        method = self.worker_cls.sleep if t.action is Action.SLEEP else self.worker_cls.wake_up
        return self.submit(CallOptions(after=after), method, parts=t.parts)

    def _start(
        self,
        options: CallOptions,
        method: Callable[..., R],
        rows: Rows | None,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> Pending[R]:
        name = method.__name__
        if getattr(self.worker_cls, name, None) is not method:
            raise TypeError(f"{method.__qualname__} is not a method of {self.worker_cls.__name__}")
        if kwargs.keys() & {"wake_first", "sleep_after"}:
            raise TypeError(f"{name}: pass wake_first / sleep_after as CallOptions")
        per_sample = {k: v for k, v in kwargs.items() if isinstance(v, Tensor)}
        if rows is None and per_sample:
            raise TypeError(f"{name}: per-sample tensors {sorted(per_sample)} without rows")
        plain = {k: v for k, v in kwargs.items() if k not in per_sample}
        plain.update(options.lifecycle())
        rows_refs = rows.shards(self.dp_size) if rows is not None else None
        sample_refs = (
            [
                ray.put({k: t[s].contiguous() for k, t in per_sample.items()})
                for s in rows.split(self.dp_size)
            ]
            if rows is not None and per_sample
            else None
        )
        before = [ref for p in options.after for ref in p.refs]
        refs: list[ray.ObjectRef[tuple[R, Timeline]]] = [
            handle.call.remote(
                name,
                rows_refs[dp] if rows_refs is not None else None,
                sample_refs[dp] if sample_refs is not None else {},
                plain,
                *before,
                args=args,
            )
            for handle, dp in zip(self.handles, self._dp_of, strict=True)
        ]
        order = rows.order(self.dp_size) if rows is not None else None
        return Pending(refs, self.leaders, self.lost, self.owns, order)

    def kill(self, *, grace_s: float = 10.0) -> None:
        """End every rank: it exits by itself once its current call returns (within
        ``grace_s``), then ``ray.kill``. A rank killed in the middle of a call (say a
        checkpoint write, when its peer died) printed an interpreter traceback."""
        exits = [h.__ray_terminate__.remote() for h in self.handles]
        ray.wait(exits, num_returns=len(exits), timeout=grace_s)
        for handle in self.handles:
            ray.kill(handle)
        self.handles = []


def data_parallel_layout(meshes: Sequence[Mesh]) -> tuple[list[int], list[int]]:
    """(the data-parallel rank of each rank, the first rank of each data-parallel group).

    Raises ``ValueError`` when the ranks disagree on the data-parallel size or a
    data-parallel rank has no member (a mesh the workers did not report consistently).
    """
    sizes = {m.dp_size for m in meshes}
    if len(sizes) != 1:
        raise ValueError(f"the ranks report different data-parallel sizes {sorted(sizes)}")
    dp_of = [m.dp_rank for m in meshes]
    (dp_size,) = sizes
    missing = [d for d in range(dp_size) if d not in dp_of]
    if missing:
        raise ValueError(f"data-parallel rank(s) {missing} of {dp_size} have no member")
    return dp_of, [dp_of.index(d) for d in range(dp_size)]


def _rows_of(tensors: Mapping[str, Tensor]) -> int:
    return int(next(iter(tensors.values())).shape[0])


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the group's data-parallel rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
