"""The two models on the shared training devices: both worker groups, who is resident.

:class:`TrainPair` owns the actor group, the critic group, the residency planner
(``ppo_lifecycle.ResidencyPlanner``: the driver's single copy of who holds the
devices) and the queue of transitions started and not yet awaited. Every worker call
of a run goes through one of its typed methods, which asks the planner first and
carries its choice inside the call (``wake_first`` / ``sleep_after``); transitions the
call cannot carry (the other model's sleep) are queued as their own calls, and Ray
holds the call back until they have finished (the driver does not wait for them).

Start-up, checkpoints, the HF export and the refit go through the same plan:
:meth:`TrainPair.start` builds the models one at a time (the actor sleeps, by the
plan, before the critic is built), :meth:`TrainPair.save` writes both in the plan's
order, :meth:`TrainPair.refit` makes the actor resident before the weights leave.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import ray
from ppo_lifecycle import CallPlan, Phase, ResidencyPlanner, Role, Transition, Work
from ppo_trainer import ActorWorker, CriticWorker
from torch import Tensor

from ppo_driver.trace import TraceRecorder

if TYPE_CHECKING:
    from ppo_driver.rollout._types import ActorRef
from ppo_driver.workers import (
    CallOptions,
    GroupResult,
    Pending,
    Rows,
    Timeline,
    TrainGroup,
)

__all__ = ["Planned", "Started", "TrainPair"]

log = logging.getLogger("ppo_driver.pair")

T = TypeVar("T")
R_co = TypeVar("R_co", covariant=True)

Metrics = dict[str, float]

_PHASE_OF = {
    Phase.VALUE_FORWARD: "value",
    Phase.POLICY_FORWARD: "logprob",
    Phase.POLICY_BACKWARD: "backward",
    Phase.POLICY_UPDATE: "update",
    Phase.CRITIC_TRAIN: "critic",
    Phase.REFIT: "export",  # the actor's weights read between steps (the HF export)
}


@dataclass(eq=False)
class _Queued:
    """A transition started and not yet awaited."""

    pending: Pending[None]
    label: str
    step: int


@dataclass(frozen=True)
class Planned:
    """The planner's choice for one call of ``role`` doing ``phase`` (the transitions
    before it that the call does not carry are already queued)."""

    role: Role
    phase: Phase
    step: int
    plan: CallPlan


@dataclass(frozen=True)
class Started(Generic[R_co]):
    """A worker call started, with the queued transitions it waits for; :meth:`result`
    waits for it and traces its parts."""

    pair: TrainPair
    pending: Pending[R_co]
    deps: Sequence[_Queued]
    step: int
    phase: str

    def result(self) -> GroupResult[R_co]:
        result = self.pending.result()
        self.pair.settle(self.deps)
        self.pair.trace_timeline(result.timeline, self.step, phase=self.phase)
        return result


class TrainPair:
    """The actor and critic groups time-sharing the training devices.

    Until :meth:`start` has run the models are not built; after it, as at every step
    boundary, the actor is asleep and the critic resident (the planner's start state).
    """

    def __init__(
        self,
        actor: TrainGroup[ActorWorker],
        critic: TrainGroup[CriticWorker],
        *,
        trace: TraceRecorder,
    ) -> None:
        self.actor, self.critic, self.trace = actor, critic, trace
        self.planner = ResidencyPlanner(resident=Role.CRITIC)
        self._queued: list[_Queued] = []  # transitions started, not yet awaited, in order

    @property
    def resident(self) -> Role | None:
        return self.planner.resident

    @property
    def switches(self) -> int:
        """Wake-ups so far (the planner's count)."""
        return self.planner.switches

    # ---------------------------------------------------------------- start-up
    def start(self, checkpoint: Path | None) -> None:
        """Build the models one at a time (two full models and optimizers never need to
        fit at once): the actor, its checkpoint, then it sleeps fully (the planner's
        ``release_all``); the critic, its checkpoint. A model just built is resident."""
        with self.trace.span("start actor", phase="startup"):
            self.actor.build()
            self.planner = ResidencyPlanner(resident=Role.ACTOR)
            if checkpoint is not None:
                self.actor.call(ActorWorker.load_checkpoint, str(checkpoint / Role.ACTOR))
            self.release_all(step=0)
        log.info("start-up: actor built%s and asleep", " and loaded" if checkpoint else "")
        with self.trace.span("start critic", phase="startup"):
            self.critic.build()
            self.planner = ResidencyPlanner(resident=Role.CRITIC)
            if checkpoint is not None:
                self.critic.call(CriticWorker.load_checkpoint, str(checkpoint / Role.CRITIC))

    def processes(self) -> list[str]:
        """``"<role> rank <r> pid <pid> on <ip>"`` for every rank of both groups."""
        return [
            f"{g.role} rank {r} pid {pid} on {ip}"
            for g in (self.actor, self.critic)
            for r, (pid, ip) in enumerate(g.processes)
        ]

    # ---------------------------------------------------------------- the step's calls
    def plan(self, role: Role, phase: Phase, step: int, *, then: Sequence[Phase] = ()) -> Planned:
        """The planner's choice for one call of ``role``; the transitions it puts before
        the call that the call does not carry (the other model's sleep) are queued."""
        plan = self.planner.call(role, phase, then=then)
        for t in plan.before:
            self._queue(t, step)
        return Planned(role, phase, step, plan)

    def values(self, rows: Rows, *, step: int, then: Sequence[Phase] = ()) -> Started[Tensor]:
        """The critic's value forward (``[B, T]`` values, the batch's row order)."""
        p = self.plan(Role.CRITIC, Phase.VALUE_FORWARD, step, then=then)
        pending = self.critic.submit_rows(self._options(p), CriticWorker.compute_values, rows)
        return self._started(p, pending)

    def train_chunk(
        self,
        planned: Planned,
        rows: Rows,
        *,
        advantages: Tensor,
        loss_denominator: float,
        engine_logprobs: Tensor | None = None,
        keep: bool = False,
    ) -> Started[Metrics]:
        """The actor's forward + backward of one chunk (``planned``: a plan of the actor
        doing ``POLICY_BACKWARD``, made before the critic's values arrived)."""
        assert (planned.role, planned.phase) == (Role.ACTOR, Phase.POLICY_BACKWARD), planned
        pending = self.actor.submit_rows(
            self._options(planned),
            ActorWorker.train_chunk,
            rows,
            advantages=advantages,
            loss_denominator=loss_denominator,
            engine_logprobs=engine_logprobs,
            keep=keep,
        )
        return self._started(planned, pending)

    def finish_step(self, *, step: int, loss_denominator: float | None) -> Started[Metrics]:
        """The actor's optimizer + scheduler step, started (``.result().reduced()``: its
        all-reduced metrics)."""
        p = self.plan(Role.ACTOR, Phase.POLICY_UPDATE, step)
        pending = self.actor.submit(
            self._options(p), ActorWorker.finish_step, loss_denominator=loss_denominator
        )
        return self._started(p, pending)

    def train_epochs(self, *, step: int, epochs: int, loss_denominator: float) -> Started[Metrics]:
        """Policy epochs 2..K over the chunks the actor ranks kept, started (the result:
        the last update's metrics)."""
        p = self.plan(Role.ACTOR, Phase.POLICY_UPDATE, step)
        pending = self.actor.submit(
            self._options(p),
            ActorWorker.train_epochs,
            epochs=epochs,
            loss_denominator=loss_denominator,
        )
        return self._started(p, pending)

    def train_critic(
        self,
        rows: Rows,
        *,
        step: int,
        returns: Tensor,
        old_values: Tensor,
        epochs: int,
        mini_batch_size: int,
        meanwhile: Callable[[Pending[Metrics]], object] | None = None,
    ) -> Metrics:
        """The critic's epochs over the step batch; metrics averaged over its
        data-parallel ranks. ``meanwhile(call)`` runs once the call is started (other
        driver work while it runs, e.g. collecting generation, until ``call.done()``)."""
        p = self.plan(Role.CRITIC, Phase.CRITIC_TRAIN, step)
        pending = self.critic.submit_rows(
            self._options(p),
            CriticWorker.train,
            rows,
            returns=returns,
            old_values=old_values,
            epochs=epochs,
            mini_batch_size=mini_batch_size,
        )
        started = self._started(p, pending)
        if meanwhile is not None:
            meanwhile(pending)
        out = started.result()
        return {k: v / len(out.values) for k, v in out.summed().items()}

    def actor_counters(self) -> Metrics:
        """The actor's pass counters, summed over its data-parallel ranks."""
        return self.actor.call(ActorWorker.counters).summed()

    # ---------------------------------------------------------------- between steps
    def export_policy(self, *, step: int) -> dict[str, Tensor]:
        """The policy's weights under Hugging Face names (a collective over the actor
        group; the actor is woken if needed)."""
        p = self.plan(Role.ACTOR, Phase.REFIT, step)
        pending = self.actor.submit(self._options(p), ActorWorker.export_weights)
        weights = self._started(p, pending).result().values[0]
        assert weights is not None  # data-parallel rank 0's first rank is the source
        return weights

    def save(self, directory: Path, *, step: int) -> None:
        """Both models' checkpoints under ``directory/actor`` and ``directory/critic``,
        in the plan's order (the resident one first), ending with the critic resident."""
        self.settle()
        for item in self.planner.checkpoint(end_resident=Role.CRITIC):
            if isinstance(item, Work):
                path = str(directory / str(item.role))
                if item.role is Role.ACTOR:
                    self.actor.call(ActorWorker.save_checkpoint, path)
                else:
                    self.critic.call(CriticWorker.save_checkpoint, path)
            else:
                self.execute([item], step)

    def refit(self, step: int, push: Callable[[], T]) -> T:
        """``push()`` (the weight transfer, which calls the actor's ranks through
        :meth:`refit_source`) once the plan has made the actor resident; a rank that
        dies meanwhile is named as one a group call sees (:class:`WorkerLost`)."""
        self.before(step, Phase.REFIT)
        try:
            return push()
        except ray.exceptions.RayActorError as exc:
            if self.actor.owns(exc):
                raise self.actor.lost(exc) from exc
            raise

    def refit_source(self) -> tuple[ActorRef, list[ActorRef]]:
        """(the actor's rank 0, its other ranks): the refit's sender and the peers that
        join the weight export's collective."""
        return self.actor.handles[0], list(self.actor.handles[1:])

    def release_all(self, step: int) -> None:
        """The resident model (if any) sleeps with all its parts, leaving the devices
        free (colocated generation between steps)."""
        self.execute(self.planner.release_all(), step)

    # ---------------------------------------------------------------- transitions
    def before(self, step: int, *phases: Phase, wait: bool = True) -> None:
        """Run the transitions the plan puts before ``phases`` (normally none: calls
        carry them). ``wait=False``: queued (e.g. the actor's sleep and the critic's
        wake-up while the pump waits for the next chunk); the next call waits for them."""
        self.execute(self.planner.before(*phases), step, wait=wait)

    def execute(self, transitions: Sequence[Transition], step: int, *, wait: bool = True) -> None:
        """Queue ``transitions`` in order; ``wait``: and wait for everything queued."""
        for t in transitions:
            self._queue(t, step)
        if wait:
            self.settle()

    def settle(self, done: Sequence[_Queued] | None = None) -> None:
        """Wait for queued transitions (``done``, default all; surfaces their errors)
        and trace them."""
        queued = {id(q) for q in self._queued}  # one awaited (and traced) already is done
        for q in [q for q in (self._queued if done is None else done) if id(q) in queued]:
            result = q.pending.result()  # a failure stays queued: awaited again, not lost
            self._queued = [other for other in self._queued if other is not q]
            self.trace_timeline([(q.label, *result.timeline[0][1:])], q.step, "switch")

    def trace_timeline(self, timeline: Timeline, step: int, phase: str) -> None:
        """A call's parts (rank 0's wall-clock times), placed on the driver's timeline."""
        shift = time.perf_counter() - time.time()
        for label, t0, t1 in timeline:
            is_switch = ".sleep" in label or ".wake_up" in label
            self.trace.add(
                label,
                start_s=t0 + shift,
                end_s=t1 + shift,
                step=step,
                phase="switch" if is_switch else phase,
            )

    def _queue(self, t: Transition, step: int) -> None:
        """Start ``t`` once every transition queued before it has finished: one model's
        sleep always ends before the other's wake-up starts, without the driver waiting."""
        group = self.actor if t.role is Role.ACTOR else self.critic
        pending = group.transition(t, after=[q.pending for q in self._queued])
        self._queued.append(_Queued(pending, str(t), step))

    def _options(self, planned: Planned) -> CallOptions:
        """The plan's lifecycle choice; the call starts once every transition queued so
        far has finished (Ray holds it back; the driver goes on)."""
        plan = planned.plan
        return CallOptions(
            wake_first=plan.wake_parts if plan.wake_first else False,
            sleep_after=plan.sleep_after,
            after=[q.pending for q in self._queued],
        )

    def _started(self, planned: Planned, pending: Pending[T]) -> Started[T]:
        deps = list(self._queued)
        return Started(
            self, pending, deps, planned.step, _PHASE_OF.get(planned.phase, str(planned.phase))
        )
