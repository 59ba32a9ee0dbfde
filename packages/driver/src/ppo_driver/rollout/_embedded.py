"""The embedded generation engine: a Hugging Face causal LM decoding with its KV cache
inside a Ray actor (the CPU default; also runs on one GPU).

Threaded actor with batching across calls: the groups of all ``generate`` calls waiting
in the engine are decoded together as one batch (a *round*; rows leave it as they
finish), and each call returns as soon as its own groups are done, while the round goes
on with the longer ones. Short groups therefore come back first: the long tail of a
real engine (sglang's continuous batching), minus joining a round already running.
``pause_generation``, ``health`` and the refit calls run beside them. A new weight
version is received concurrently with generation, then swapped in under the lock, i.e.
strictly between two rounds; every output carries the version that produced all of
its samples. An engine that Ray restarted holds the weights it was built with, not the
current policy: it refuses to generate (:class:`EngineRestarted`) until it has received
weights (or the driver confirmed its initial ones are current).

Releasing memory (``release_memory``, while colocated trainers hold the devices) puts
the weights to sleep with :class:`ppo_lifecycle.OffloadManager` (the trainers'
mechanism, ``host_copy``): on CUDA they go to pinned host memory; on a CPU "device"
they leave the process (its resident memory drops by their size). A weight update
while released wakes them, writes, and releases them again. ``released=True`` starts
the engine that way (and paused: ``resume_memory`` + ``continue_generation`` first).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NotRequired, TypedDict, TypeVar

import torch
from ppo_lifecycle import ALL_PARTS, OffloadManager

from ._model import ModelSource, build_model
from ._refit import (
    CheckpointLayout,
    RefitGroup,
    connect_group,
    load_weights_from_disk,
    receive_state_dict,
)
from ._sampling import generate_rows, sample_seed
from ._types import (
    ActorRef,
    EngineHealth,
    EngineRestarted,
    GroupOutput,
    GroupRequest,
    SampleOutput,
    SamplingParams,
    check_requests,
    check_vouched_version,
    restarted_by_ray,
)

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.scheduling_strategies import SchedulingStrategyT

_E = TypeVar("_E")

_log = logging.getLogger(__name__)

_GATHER_LIMIT = 10  # a round gathers for at most this many gather windows


@dataclass(eq=False)
class _Ticket:
    """One group waiting in the engine, then decoding in a round."""

    request: GroupRequest
    samples: list[SampleOutput | None] = field(default_factory=list)
    output: GroupOutput | None = None
    error: BaseException | None = None
    done: bool = False
    waiter: threading.Condition | None = None  # its call's, notified when it is done


class EmbeddedEngine:
    """A generation engine over a Hugging Face causal LM.

    Args:
        model: what :func:`build_model` accepts (a ``ppo_trainer.ModelSpec``, a
            ``transformers`` config or a local model directory).
        run_seed: the run's seed; sample ``j`` of prompt ``i`` generated with weight
            version ``v`` draws from ``sample_seed(run_seed, i, j, v)``.
        engine_id: a name for logs and outputs.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when visible).
        num_threads: torch intra-op threads on CPU (default 1: engines share cores).
        batch_groups: decode the waiting groups (of every ``generate`` call) that share
            a prompt length as one batch (deterministic on batch-invariant kernels,
            e.g. CPU); ``False``: one group per round.
        weight_version: the version of the initial weights.
        gather_s: a round starts once no call has joined it for this long (calls sent
            together, e.g. one per group of a step, arrive one after another: each
            arrival keeps the round open), and at the latest ``10 * gather_s`` after
            it began gathering.
        step_delay_s: each decode step takes at least this long: the engine sleeps what
            its compute left of it (emulates a device of that speed, whatever else runs
            on the host's cores while the compute fits in the period).
        released: start with the memory released and generation paused (colocated
            engines: the trainers are built while the engines hold nothing). A start
            after Ray restarted the engine is resident (it died generating, when the
            devices are the engines').
    """

    def __init__(
        self,
        *,
        model: ModelSource,
        run_seed: int,
        engine_id: str = "engine",
        device: str = "cpu",
        num_threads: int | None = 1,
        batch_groups: bool = True,
        weight_version: int = 0,
        gather_s: float = 0.05,
        step_delay_s: float = 0.0,
        released: bool = False,
    ) -> None:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if num_threads is not None and device == "cpu":
            torch.set_num_threads(num_threads)
        self.engine_id = engine_id
        self.run_seed = int(run_seed)
        self.device = torch.device(device)
        self.batch_groups = batch_groups
        self.model = build_model(model, device=str(self.device))
        self.weight_version = int(weight_version)
        self.incarnation = uuid.uuid4().hex
        self.groups_served = 0
        self.rounds = 0
        self.gather_s = float(gather_s)
        self._lock = threading.Lock()  # the weights: held by a round, or a refit swap
        self._mutex = threading.RLock()  # queue, tickets, round, pause, busy
        self._cv = threading.Condition(self._mutex)  # pause_generation waits on it
        self._waiters: set[threading.Condition] = set()  # one per generate() call waiting
        self._queue: list[_Ticket] = []
        self._leading = False  # a round gathers or decodes: no other may start
        self._last_arrival = 0.0  # when the latest generate() call queued its groups
        self._busy = 0
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._released = False
        # the mechanism of release_memory / resume_memory (no optimizer, no gradients)
        self._memory = OffloadManager(
            self.model,
            device=self.device,
            backend="host_copy",
            name=engine_id,
            keep_gradients=False,
        )
        self._groups: dict[str, RefitGroup] = {}
        self._slow_step_s = float(step_delay_s)
        self._step_t0 = 0.0  # when the current decode step started (pacing)
        self._round: Sequence[_Ticket] = ()  # the groups decoding now
        self._drawn = 0  # tokens every unfinished row of the running round has drawn
        self._needs_weights = restarted_by_ray()
        if self._needs_weights:
            _log.warning(
                "engine %s was restarted by Ray: it holds its initial weights (version %d) "
                "and generates again once it has received the current ones",
                engine_id,
                self.weight_version,
            )
        elif released:
            self.pause_generation()
            self.release_memory()

    # -- generation -----------------------------------------------------------------------
    def generate(self, requests: Sequence[GroupRequest]) -> list[GroupOutput]:
        """Generate every group; one output per request, in order. Returns when all of
        them are done; groups of other calls waiting at the same time share the batch.
        Raises :class:`EngineRestarted` while a restarted engine waits for weights."""
        check_requests(requests)
        if self._needs_weights:
            raise EngineRestarted(
                f"engine {self.engine_id} was restarted by Ray and still holds its initial "
                f"weights (version {self.weight_version}); it generates again once the "
                "driver pushed the current weights (WeightRefitter.restore_engine)"
            )
        # this call's own condition (on the engine's lock): a finished group wakes only
        # its call, not every call waiting (one thread per call in flight: 64 a step)
        mine = threading.Condition(self._mutex)
        tickets = [_Ticket(request=r, samples=[None] * r.params.n, waiter=mine) for r in requests]
        with self._cv:  # (an arrival wakes nobody: a gathering round re-reads the clock)
            self._queue.extend(tickets)
            self._last_arrival = time.monotonic()
            self._waiters.add(mine)
        try:
            self._generate(tickets, mine)
        finally:
            with self._cv:
                self._waiters.discard(mine)
        for t in tickets:
            if t.error is not None:
                raise t.error
        return [t.output for t in tickets if t.output is not None]

    def _generate(self, tickets: Sequence[_Ticket], mine: threading.Condition) -> None:
        """Wait until ``tickets`` are done, starting the next round when nobody decodes.

        The round decodes on a thread of its own, not on the call that started it: each
        call returns as soon as its own groups are done, the starting one included (had
        it decoded the round itself, its groups would have come back only with the
        round's last, and with ``async_rl.block_order: length`` a group not back holds
        every group after it)."""
        while True:
            with self._cv:
                while not all(t.done for t in tickets) and (
                    self._leading or not self._unpaused.is_set() or not self._queue
                ):
                    mine.wait()
                if all(t.done for t in tickets):
                    return
                # nobody decodes and groups wait: this call starts the next round, once
                # the calls sent together have joined it (a quiet gather_s, bounded)
                self._leading = True
                latest = time.monotonic() + _GATHER_LIMIT * self.gather_s
                while (
                    rest := min(self._last_arrival + self.gather_s, latest) - time.monotonic()
                ) > 0:
                    mine.wait(timeout=rest)
                round_ = self._take_round()
                self.rounds += 1
                self._busy += len(round_)
                self._round, self._drawn = round_, 0
                threading.Thread(
                    target=self._decode,
                    args=(round_,),
                    name=f"{self.engine_id}-round-{self.rounds}",
                    daemon=True,
                ).start()

    def _decode(self, round_: Sequence[_Ticket]) -> None:
        """One round, on its own thread: a failure fails the round's unfinished groups
        (their calls raise it); at the end the next round may start."""
        try:
            self._run_round(round_)
        except BaseException as exc:
            for t in round_:
                if not t.done:
                    t.error = exc
        finally:
            with self._cv:
                for t in round_:
                    t.done = True
                self._round, self._drawn = (), 0
                self._leading = False
                self._busy -= len(round_)
                self._wake_all()

    def _wake_all(self) -> None:
        """A change every waiter may act on (a round ended, generation resumed); under
        the engine's lock."""
        self._cv.notify_all()
        for waiter in self._waiters:
            waiter.notify()

    def _take_round(self) -> list[_Ticket]:
        """The waiting groups with the oldest one's prompt length (one if not batching)."""
        first = self._queue[0]
        if not self.batch_groups:
            return [self._queue.pop(0)]
        length = len(first.request.prompt_ids)
        round_ = [t for t in self._queue if len(t.request.prompt_ids) == length]
        self._queue = [t for t in self._queue if len(t.request.prompt_ids) != length]
        return round_

    def _run_round(self, round_: Sequence[_Ticket]) -> None:
        with self._lock:
            if self._released:
                raise RuntimeError(
                    f"engine {self.engine_id}: generate() while memory is released; "
                    "call resume_memory() first"
                )
            version = self.weight_version
            prompts: list[tuple[int, ...]] = []
            params: list[SamplingParams] = []
            seeds: list[int] = []
            owner: list[tuple[_Ticket, int]] = []
            for t in round_:
                req = t.request
                for j in range(req.params.n):
                    prompts.append(req.prompt_ids)
                    params.append(req.params)
                    seeds.append(
                        sample_seed(
                            run_seed=self.run_seed,
                            prompt_index=req.prompt_index,
                            sample_index=j,
                            weight_version=version,
                        )
                    )
                    owner.append((t, j))

            def finished(row: int, sample: SampleOutput) -> None:
                ticket, j = owner[row]
                ticket.samples[j] = sample
                done = [s for s in ticket.samples if s is not None]
                if len(done) == len(ticket.samples):  # the group is complete: its call returns now
                    req = ticket.request
                    ticket.output = GroupOutput(
                        prompt_index=req.prompt_index,
                        prompt_ids=tuple(req.prompt_ids),
                        samples=tuple(done),
                        weight_version=version,
                        engine_id=self.engine_id,
                    )
                    with self._cv:
                        ticket.done = True
                        self.groups_served += 1
                        if ticket.waiter is not None:
                            ticket.waiter.notify()

            self._step_t0 = time.perf_counter()
            generate_rows(
                self.model,
                prompts,
                params=params,
                seeds=seeds,
                device=self.device,
                between_steps=self._between_steps,
                on_finish=finished,
            )

    def _between_steps(self) -> None:
        """Count the round's decode steps; pace them at ``step_delay_s`` each (sleep the
        rest of this one)."""
        with self._cv:
            self._drawn += 1
        if self._slow_step_s > 0:
            time.sleep(max(0.0, self._step_t0 + self._slow_step_s - time.perf_counter()))
            self._step_t0 = time.perf_counter()

    def progress(self) -> dict[int, int]:
        """How far each group this engine holds and has not finished got: prompt index ->
        tokens each of its unfinished samples has drawn (0 while it waits for a round).
        Every sample still running draws at least one more token, so such a group's
        longest response will be longer than this. A group that finished is not listed
        (its ``generate`` call is returning). Read while rounds run (a control thread)."""
        with self._cv:
            out = {t.request.prompt_index: 0 for t in self._queue}
            out.update({t.request.prompt_index: self._drawn for t in self._round if not t.done})
            return out

    def set_gather_window(self, seconds: float) -> None:
        """How long a new round waits for another call to join it (default 50 ms)."""
        self.gather_s = float(seconds)

    def set_step_delay(self, seconds: float) -> None:
        """Testing aid: each decode step takes at least this long (0 disables)."""
        self._slow_step_s = float(seconds)

    # -- lifecycle --------------------------------------------------------------------------
    def pause_generation(self) -> None:
        """Start no new round; return once the running one (if any) finished."""
        with self._cv:
            self._unpaused.clear()
            while self._busy > 0:
                self._cv.wait()

    def continue_generation(self) -> None:
        with self._cv:
            self._unpaused.set()
            self._wake_all()

    def release_memory(self) -> None:
        """Put the weights to sleep (off the device: pinned host memory on CUDA, out of
        the process on a CPU "device"); idempotent."""
        with self._lock:
            if self._released:
                _log.info(
                    "engine %s: release_memory() while released; nothing to do", self.engine_id
                )
                return
            self._memory.sleep(parts=ALL_PARTS)
            self._released = True

    def resume_memory(self) -> None:
        with self._lock:
            if not self._released:
                _log.info(
                    "engine %s: resume_memory() while resident; nothing to do", self.engine_id
                )
                return
            self._memory.wake_up(parts=ALL_PARTS)
            self._released = False

    def health(self) -> EngineHealth:
        return EngineHealth(
            alive=True,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            weight_version=self.weight_version,
            paused=not self._unpaused.is_set(),
            memory_released=self._released,
            groups_served=self.groups_served,
            needs_weights=self._needs_weights,
            extra={
                "pid": os.getpid(),
                "device": str(self.device),
                "busy": self._busy,
                "rounds": self.rounds,
            },
        )

    # -- weights ----------------------------------------------------------------------------
    def _apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> int:
        layout = CheckpointLayout({n: tuple(p.shape) for n, p in self.model.state_dict().items()})
        problem = layout.mismatch({n: t.shape for n, t in tensors.items()})
        if problem is not None:  # checked before any copy: a mismatch changes nothing
            raise ValueError(
                f"engine {self.engine_id}: weights for version {version} do not match the "
                f"model ({problem}); the engine and the trainer must build the same "
                "architecture"
            )
        with self._lock, torch.no_grad():
            if self._released:  # released (colocated): wake, write, release again
                self._memory.wake_up(parts=ALL_PARTS)
            try:
                params = self.model.state_dict()
                for name, tensor in tensors.items():
                    params[name].copy_(tensor)
            finally:
                if self._released:
                    self._memory.sleep(parts=ALL_PARTS)
            self.weight_version = int(version)
            self._needs_weights = False
        return self.weight_version

    def confirm_weights(self, *, version: int) -> int:
        """The driver vouches that this engine's weights are ``version`` (see
        :class:`RolloutEngine`); a restarted engine generates again."""
        with self._lock:
            check_vouched_version(self.engine_id, holds=self.weight_version, version=version)
            self._needs_weights = False
        return self.weight_version

    def init_refit_group(
        self,
        *,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        group_name: str,
    ) -> None:
        local = master_addr
        if master_addr not in ("127.0.0.1", "localhost"):
            import ray

            local = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self.close_refit_group(group_name=group_name)  # the same name joined again
        self._groups[group_name] = connect_group(
            store=None,
            master_addr=master_addr,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            local_addr=local,
        )

    def close_refit_group(self, *, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is not None:
            group.close()

    def receive_weights(self, *, group_name: str) -> int:
        group = self._groups.get(group_name)
        if group is None:
            raise ValueError(
                f"engine {self.engine_id}: no refit group {group_name!r}; call init_refit_group first"
            )
        version, tensors = receive_state_dict(group=group)
        return self._apply(version, tensors)

    def update_weights_from_disk(self, path: str, *, version: int) -> int:
        disk_version, tensors = load_weights_from_disk(path)
        if disk_version != version:
            raise ValueError(
                f"engine {self.engine_id}: {path} holds version {disk_version}, not {version}"
            )
        return self._apply(version, tensors)

    def update_weights(self, tensors: Mapping[str, torch.Tensor], *, version: int) -> int:
        """Apply in-memory tensors (tests, and a driver that already holds them)."""
        return self._apply(version, tensors)

    def crash(self) -> None:
        """Testing aid: kill this engine's process (Ray restarts the actor)."""
        os._exit(1)


class EngineActorOptions(TypedDict):
    """Ray actor options of one engine (``ActorClass.options(**opts)``)."""

    num_cpus: float
    num_gpus: float
    max_restarts: int
    max_task_retries: int
    max_concurrency: int
    scheduling_strategy: NotRequired[SchedulingStrategyT]


def engine_actor_options(
    count: int,
    *,
    scheduling_strategies: Sequence[SchedulingStrategyT] | None,
    num_cpus: float,
    num_gpus: float,
    max_restarts: int,
    max_concurrency: int,
) -> list[EngineActorOptions]:
    """Ray actor options of ``count`` engines (any engine class): engine ``i`` placed by
    ``scheduling_strategies[i]``; Ray restarts a dead engine but never retries a call in
    flight (the rollout manager re-dispatches its groups)."""
    if count < 1:
        raise ValueError(f"count={count}: start at least one engine")
    if scheduling_strategies is not None and len(scheduling_strategies) != count:
        raise ValueError(
            f"got {len(scheduling_strategies)} scheduling strategies for {count} engines"
        )
    out = []
    for i in range(count):
        opts: EngineActorOptions = {
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "max_restarts": max_restarts,
            "max_task_retries": 0,
            "max_concurrency": max_concurrency,
        }
        if scheduling_strategies is not None:
            opts["scheduling_strategy"] = scheduling_strategies[i]
        out.append(opts)
    return out


def launch_embedded_engines(
    count: int,
    *,
    model: ModelSource,
    run_seed: int,
    scheduling_strategies: Sequence[SchedulingStrategyT] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    device: str = "cpu",
    max_restarts: int = -1,
    max_concurrency: int = 64,
    batch_groups: bool = True,
    name_prefix: str = "engine",
    step_delay_s: float = 0.0,
    released: bool = False,
) -> list[ActorRef]:
    """Start ``count`` :class:`EmbeddedEngine` Ray actors (``released``: with their
    memory released and generation paused, see :class:`EmbeddedEngine`).

    ``scheduling_strategies[i]`` (e.g. a rollout bundle's strategy from
    ``ppo_placement``) places engine ``i``. Ray restarts a dead engine up to
    ``max_restarts`` times (``-1``: always); calls in flight are NOT retried by Ray
    (``max_task_retries=0``): the rollout manager re-dispatches their groups itself, so
    each group is generated exactly once.
    """
    import ray

    cls = ray.remote(EmbeddedEngine)
    handles: list[ActorRef] = []
    for i, opts in enumerate(
        engine_actor_options(
            count,
            scheduling_strategies=scheduling_strategies,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=max_restarts,
            max_concurrency=max_concurrency,
        )
    ):
        handles.append(
            started_actor(
                cls.options(**opts).remote(
                    model=model,
                    run_seed=run_seed,
                    engine_id=f"{name_prefix}-{i}",
                    device=device,
                    batch_groups=batch_groups,
                    step_delay_s=step_delay_s,
                    released=released,
                )
            )
        )
    return handles


def started_actor(started: ActorHandle[_E] | type[_E]) -> ActorRef:
    """The handle ``ActorClass.remote()`` returned: Ray's stubs type it as
    ``ActorHandle[T] | type[T]`` (its typed-actor proxy); at run time it is always the
    handle."""
    from ray.actor import ActorHandle

    assert isinstance(started, ActorHandle), type(started)
    return started
