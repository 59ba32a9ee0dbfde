"""The train pump: one PPO step at a time, streaming chunks as generation finishes them.

:meth:`TrainPump.run_step` reads top to bottom like this step schedule (the streaming
document's; the worker calls are in docs/interfaces.md):

    for each chunk the sampler releases:
        critic: value forward (unchanged critic)           -> old values
        driver: GAE per sample, advantages whitened with statistics fixed before the
                step (``normalization: previous_step``) or per chunk (``chunk``)
        actor : one call: forward + backward, loss scaled by the whole step's count;
                the old log-probs are this forward's own (the weights do not change
                until the update); with K policy epochs the rank keeps them
    after the last chunk:
        actor : one optimizer step; epochs 2..K over the kept chunks (one update each)
                -> refit (generation gets the new policy)
        critic: critic_ppo_epochs over the assembled step batch
        driver: release the step's rows, count the step

Colocated generation (``cluster.colocate``, full batch only; no look-ahead: validate)
time-shares the training devices with both models: the engines hold them only while
no trainer model is resident. They start released; each step then runs

    generation: engines resume (memory, then generation); both trainers asleep
    after the batch: engines pause and release their memory
    critic, actor: the step above (value forward, policy epochs and updates), then
                critic training
    actor : refit (the engines take the weights while released: the actor's weights
            and theirs are the only two on the devices), then the actor sleeps
    generation: engines resume (evaluation between steps runs on them); a checkpoint
            or an export between steps releases them again first

The pump owns the plan: who is resident when (``ppo_lifecycle.ResidencyPlanner``, whose
choice travels inside each worker call as ``wake_first`` / ``sleep_after``), when to
refit, when a checkpoint may be taken. The workers own the mechanism.

Log lines (the document's way to verify chunking), for every chunk and every step::

    train_pump: step <S> chunk <K>: <G> groups, <N> samples
    train_pump: step <S> closing on <K> chunk(s)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from ppo_lifecycle import (
    Action,
    CallPlan,
    Phase,
    ResidencyPlanner,
    Role,
    Transition,
    Work,
)
from ppo_sampler import Sampler
from ppo_trainer import Moments, gae, masked_moments, masked_whiten, whiten_with

from ppo_driver.batch import ChunkBatch, StepBatch
from ppo_driver.config import DriverConfig
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import (
    GroupResult,
    Pending,
    Rows,
    Timeline,
    TrainGroup,
    mini_batch_order,
)

__all__ = [
    "ChunkGate",
    "GenerationControl",
    "InjectedFailure",
    "NonFiniteError",
    "RolloutLink",
    "StepReport",
    "TrainPump",
    "check_finite_metrics",
]

log = logging.getLogger("ppo_driver.pump")


class InjectedFailure(RuntimeError):
    """Raised at a named point when a test asks the pump to crash there."""


class NonFiniteError(FloatingPointError):
    """A step produced a non-finite loss, gradient norm or metric; the step is not
    recorded or checkpointed (the workers refuse the optimizer step itself)."""

    def __init__(self, step: int, detail: str) -> None:
        self.step = step
        super().__init__(f"step {step}: {detail}")


class ChunkGate:
    """The pump's selection logic over the real sampler (no Ray, no tensors).

    ``take`` claims the next chunk of the current step (``[]``: wait). Tail-aware
    deferral, alignment and eligibility are the sampler's (``ppo_sampler``); the gate
    tracks what this step still needs.
    """

    def __init__(self, sampler: Sampler, *, batch: int, min_groups: int, alignment: int) -> None:
        self.sampler = sampler
        self.batch = batch
        self.min_groups = min_groups
        self.alignment = alignment
        self.step = 0
        self.claimed_this_step: list[int] = []

    def begin_step(self, step: int) -> None:
        self.step = step
        self.claimed_this_step = []

    @property
    def remaining(self) -> int:
        return self.batch - len(self.claimed_this_step)

    def take(self, *, trainer_version: int) -> list[int]:
        if self.remaining == 0:
            return []
        ids = [
            int(g)
            for g in self.sampler.select(
                trainer_step=self.step,
                trainer_version=trainer_version,
                remaining=self.remaining,
                min_groups=self.min_groups,
                alignment=self.alignment,
            )
        ]
        self.claimed_this_step.extend(ids)
        return ids

    def finish_step(self) -> list[int]:
        """This step's groups, to release after both updates."""
        ids = self.claimed_this_step
        self.claimed_this_step = []
        return ids


class RolloutLink(Protocol):
    """What the pump needs from the rollout manager (``ppo_driver.rollout.RolloutManager``)."""

    def pump(self, *, trainer_step: int, timeout_s: float = 0.0) -> list[int]:
        """Dispatch what the sampler admits, wait up to ``timeout_s``, file finished
        groups (replay buffer + ``sampler.add``); returns the ids that became ready."""
        ...

    def claim(self, group_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Claim selected groups in the replay buffer and build their ``[B, T]`` batch."""
        ...

    def release(self, group_ids: Iterable[int]) -> None:
        """After both updates: drop the rows and ``sampler.mark_consumed``."""
        ...

    def redispatch_evicted(self) -> list[int]:
        """Queue again the prompts of groups a ``ready_first`` sampler evicted as stale."""
        ...


class GenerationControl(Protocol):
    """The engines as the plan sees them: weights and device sharing."""

    def refit(self, *, version: int) -> None:
        """The actor's current weights as ``version``, on every engine (also released)."""
        ...

    def pause(self) -> None:
        """Stop generating and release the engines' device memory (idempotent)."""
        ...

    def resume(self) -> None:
        """Take the memory back and generate again (idempotent)."""
        ...


@dataclass
class StepReport:
    step: int
    chunk_groups: list[int]
    group_ids: list[int]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Queued:
    """A transition started and not yet awaited."""

    pending: Pending
    label: str
    step: int


@dataclass
class _Started:
    """A worker call started, with the queued transitions it waits for."""

    pending: Pending
    deps: list[_Queued]
    step: int
    phase: str


@dataclass
class _StepState:
    """What one step gathers while it runs (the pump itself keeps only counters)."""

    step: int
    policy: bool  # False in critic warm-up: no policy work at all
    denominator: float = 0.0
    final: bool = True  # the denominator is the true count (else finish_step gets it)
    chunks: list[ChunkBatch] = field(default_factory=list)
    chunk_groups: list[int] = field(default_factory=list)
    chunk_metrics: list[dict[str, float]] = field(default_factory=list)
    waited: float = 0.0
    refit_s: float = 0.0
    raw_advantages: list[torch.Tensor] = field(default_factory=list)  # valid ones, per chunk


_CHUNK_KEYS = ("actor/valid_tokens", "loss/pg", "actor/clipfrac", "actor/approx_kl")


class TrainPump:
    """Drives the actor group, the critic group and the rollout side through PPO steps.

    At construction the actor is asleep and the critic resident (the start-up order);
    colocated engines are released (they start so).
    """

    def __init__(
        self,
        cfg: DriverConfig,
        *,
        actor: TrainGroup,
        critic: TrainGroup,
        rollout: RolloutLink,
        generation: GenerationControl,
        sampler: Sampler,
        pad_id: int,
        trace: TraceRecorder,
        fail_at: str | None = None,
        step_of: Callable[[int], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor, self.critic = actor, critic
        self.groups = {Role.ACTOR: actor, Role.CRITIC: critic}
        self.rollout, self.generation = rollout, generation
        self.gate = ChunkGate(
            sampler,
            batch=cfg.batch_groups,
            min_groups=cfg.min_groups,
            alignment=cfg.group_alignment,
        )
        self.pad_id = pad_id
        self.trace = trace
        self.planner = ResidencyPlanner(resident=Role.CRITIC)
        self.completed_steps = 0
        self.weight_version = 0
        self.fail_at = fail_at
        self.in_update = False
        # transitions started and not yet awaited, in order
        self._queued: list[_Queued] = []
        self._counted: dict[str, float] = {}  # the actor's pass counters at the last step
        # True once this step's policy is final on the engines (after the early refit):
        # the next step's prompts may then be dispatched, overlapping critic training.
        self._policy_ahead = False
        self._gen_window: dict[int, list[float]] = {}  # step -> [first poll, last arrival]
        self._step_of: Callable[[int], int] = step_of or (lambda gid: gid // cfg.batch_groups)
        # the raw advantages' statistics of the last finished step (normalization:
        # previous_step); None until a step has finished
        self.adv_stats: Moments | None = None
        # colocated generation time-shares the training devices (module docstring)
        self.colocated = cfg.cluster.colocate and not cfg.streaming
        self.engines_released = self.colocated  # colocated engines start released

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "completed_steps": self.completed_steps,
            "weight_version": self.weight_version,
            "adv_stats": None if self.adv_stats is None else list(self.adv_stats),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.completed_steps = int(state["completed_steps"])
        self.weight_version = int(state["weight_version"])
        stats = state.get("adv_stats")  # absent in checkpoints of ppo-driver < 0.7
        self.adv_stats = None if stats is None else Moments(*(float(x) for x in stats))

    def restore_generation(self) -> None:
        """After a resume: the engines get the checkpoint's policy (weight version)."""
        if self.weight_version > 0:
            self._refit(self.completed_steps, version=self.weight_version)

    def export_policy(self) -> dict[str, torch.Tensor]:
        """The policy's weights under Hugging Face names (a collective over the actor
        group, between steps; the actor is woken if needed)."""
        if self.in_update:
            raise RuntimeError("export_policy inside an update: export between steps")
        self._release_engines()
        weights = self._call(Role.ACTOR, Phase.REFIT, "export_weights", self.completed_steps)
        exported: dict[str, torch.Tensor] = weights.values[0]
        return exported

    # ---------------------------------------------------------------- one step
    def run_step(self) -> StepReport:
        """One PPO step; a worker's refusal of a non-finite loss or gradient norm (raised
        before its optimizer step) comes back as :class:`NonFiniteError` naming the step."""
        step = self.completed_steps
        try:
            return self._run_step(step)
        except FloatingPointError as exc:
            if isinstance(exc, NonFiniteError):
                raise
            cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the worker's
            raise NonFiniteError(step, str(cause)) from None

    def _run_step(self, step: int) -> StepReport:
        cfg = self.cfg
        colocated = self.colocated
        s = _StepState(step, policy=step >= cfg.ppo.critic_warmup_steps)
        t_step, switches = time.perf_counter(), self.planner.switches
        self.trace.take_step_totals()
        self.gate.begin_step(step)
        if colocated:  # generation's turn on the devices: no trainer model stays there
            self._trainers_asleep(step)
            self._resume_engines()
        self.feed_generation()
        if not colocated:
            self._switch(step, Phase.WAIT, Phase.VALUE_FORWARD)  # the critic, before the wait
        while self.gate.remaining > 0:
            chunk = self._next_chunk(s)
            if colocated and self.gate.remaining == 0:  # generated: the trainers' turn
                self._release_engines()
            with self.trace.span(f"chunk {len(s.chunks)}", step=step, phase="chunk"):
                self._train_chunk(s, chunk, more=self.gate.remaining > 0)
            if self.gate.remaining > 0:  # the critic wakes while the pump waits
                self._switch(step, Phase.WAIT, Phase.VALUE_FORWARD, wait=False)
        self._settle()
        log.info("train_pump: step %d closing on %d chunk(s)", step, len(s.chunks))
        self._maybe_fail("after_chunks", step)
        batch = StepBatch.assemble(s.chunks, pad_id=self.pad_id, group_sizes=s.chunk_groups)
        self._check_batch(batch)

        update: dict[str, float] = {}
        if s.policy:  # ONE optimizer + scheduler update (full-batch: one per policy epoch)
            update = self._policy_update(s, batch)
            self._maybe_fail("after_policy_update", step)
            if not colocated:
                self._refit_trained(s)  # early refit: before critic training
        if not colocated:  # the next step's generation overlaps critic training
            self._policy_ahead = True
            self.feed_generation()
        critic = self._critic_train(s, batch, colocated=colocated)
        ids = self.gate.finish_step()  # release consumed rows, then count the step
        self.rollout.release(ids)
        self.adv_stats = _moments(s.raw_advantages)  # the next step's normalisation
        self.completed_steps += 1
        self._policy_ahead = False
        self.in_update = False
        self._maybe_fail("after_step", step)

        metrics = self._step_metrics(s, batch, update, critic, t_step, switches)
        return StepReport(
            step=step, chunk_groups=s.chunk_groups, group_ids=sorted(ids), metrics=metrics
        )

    # ---------------------------------------------------------------- the chunk
    def _next_chunk(self, s: _StepState) -> ChunkBatch:
        ids, waited = self._wait_for_chunk(s.step)
        s.waited += waited
        self.in_update = True  # checkpoint exclusion covers the whole update
        chunk = ChunkBatch.from_rollout(self.rollout.claim(ids))
        if not s.chunks:
            s.denominator, s.final = self._loss_denominator(
                chunk, whole_step=len(ids) == self.cfg.batch_groups
            )
        s.chunk_groups.append(len(ids))
        log.info(
            "train_pump: step %d chunk %d: %d groups, %d samples",
            s.step,
            len(s.chunk_groups),
            len(ids),
            chunk.size,
        )
        return chunk

    def _train_chunk(self, s: _StepState, chunk: ChunkBatch, *, more: bool) -> None:
        """Value forward, GAE, and (streaming) the actor's forward + backward: one call
        per model; the tokens go to Ray's object store once for both.

        While streaming, no switch waits on the driver: the critic's sleep is queued
        behind its forward (it runs while the driver computes GAE, and the actor's call
        starts when it ends), and after a chunk that is not the last the actor stays
        resident; its sleep and the critic's wake-up are queued for the wait."""
        ppo = self.cfg.ppo
        rows = Rows(chunk.model_inputs())
        backward = s.policy and not self._logprob_pass
        if backward:
            after_values: tuple[Phase, ...] = ()
        elif more:
            after_values = (Phase.WAIT, Phase.VALUE_FORWARD)
        else:
            after_values = (Phase.POLICY_FORWARD if s.policy else Phase.CRITIC_TRAIN,)
        plan = self._plan(Role.CRITIC, Phase.VALUE_FORWARD, s.step, then=after_values)
        started = self._submit(
            plan, Role.CRITIC, Phase.VALUE_FORWARD, "compute_values", s.step, rows=rows
        )
        if backward:  # queues the critic's sleep now, behind its forward
            then = () if more else (Phase.POLICY_UPDATE,)
            actor_plan = self._plan(Role.ACTOR, Phase.POLICY_BACKWARD, s.step, then=then)
        chunk.old_values = self._result(started).tensor()
        advantages, chunk.returns = gae(
            rewards=chunk.rewards,
            values=chunk.old_values,
            mask=chunk.loss_mask,
            gamma=ppo.adv_estimator.gamma,
            lam=ppo.adv_estimator.lam,
        )
        chunk.advantages = self._normalize(s, advantages, chunk.loss_mask)
        if backward:
            started = self._submit(
                actor_plan,
                Role.ACTOR,
                Phase.POLICY_BACKWARD,
                "train_chunk",
                s.step,
                rows=rows,
                per_sample={
                    "advantages": chunk.advantages,
                    "engine_logprobs": chunk.engine_logprobs,
                },
                loss_denominator=s.denominator,
                keep=ppo.ppo_epochs > 1,  # the rank keeps the chunk for epochs 2..K
            )
            s.chunk_metrics.append(self._result(started).summed())
        s.chunks.append(chunk)

    def _normalize(
        self, s: _StepState, advantages: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The chunk's advantages as the actor gets them; the returns are never whitened.

        ``previous_step``: whitened with the statistics of the previous step's whole
        batch, fixed before this step (not normalised while there is none), so every
        chunk, and a full-batch step, is normalised alike. ``chunk``: with the chunk's
        own statistics (the streaming document's; full-batch: the batch's)."""
        est = self.cfg.ppo.adv_estimator
        s.raw_advantages.append(advantages[mask.bool()])
        if not est.normalize_advantages:
            return advantages
        if est.normalization == "chunk":
            return masked_whiten(values=advantages, mask=mask)
        if self.adv_stats is None or self.adv_stats.n < 2:
            return advantages
        return whiten_with(values=advantages, mask=mask, stats=self.adv_stats)

    # ---------------------------------------------------------------- after the chunks
    @property
    def _logprob_pass(self) -> bool:
        """Full-batch with several policy epochs: old log-probs from a separate forward
        (as verl and OpenRLHF compute them). Streaming never runs one: the streamed pass's
        own forward gives them, kept on the actor ranks for epochs 2..K."""
        return not self.cfg.streaming and self.cfg.ppo.ppo_epochs > 1

    def _policy_update(self, s: _StepState, batch: StepBatch) -> dict[str, float]:
        """The step's policy updates (one per epoch); returns the last one's metrics."""
        final = None if s.final else batch.valid_tokens()
        if self._logprob_pass:
            return self._full_batch_epochs(s, batch, final=final)
        update = self._call(
            Role.ACTOR, Phase.POLICY_UPDATE, "finish_step", s.step, loss_denominator=final
        ).reduced()
        epochs = self.cfg.ppo.ppo_epochs - 1
        if not epochs:
            return update
        return self._call(  # epochs 2..K over the chunks the actor ranks kept
            Role.ACTOR,
            Phase.POLICY_UPDATE,
            "train_epochs",
            s.step,
            epochs=epochs,
            loss_denominator=s.denominator if final is None else final,
        ).reduced()

    def _full_batch_epochs(
        self, s: _StepState, batch: StepBatch, *, final: float | None
    ) -> dict[str, float]:
        """Full batch, K > 1 epochs: the old log-probs from a separate forward, then one
        forward + backward and one update per epoch over the whole batch."""
        rows = Rows(batch.model_inputs())
        old = self._call(
            Role.ACTOR,
            Phase.POLICY_FORWARD,
            "compute_logprobs",
            s.step,
            then=(Phase.POLICY_BACKWARD,),
            rows=rows,
        ).tensor()
        update: dict[str, float] = {}
        for epoch in range(self.cfg.ppo.ppo_epochs):
            per_sample = {"advantages": batch.need("advantages"), "old_logprobs": old}
            if epoch == 0:  # the engine-vs-trainer gap, measured once
                per_sample["engine_logprobs"] = batch.engine_logprobs
            out = self._call(
                Role.ACTOR,
                Phase.POLICY_BACKWARD,
                "train_chunk",
                s.step,
                rows=rows,
                per_sample=per_sample,
                loss_denominator=s.denominator,
            )
            if epoch == 0:
                s.chunk_metrics.append(out.summed())
            update = self._call(
                Role.ACTOR, Phase.POLICY_UPDATE, "finish_step", s.step, loss_denominator=final
            ).reduced()
        return update

    def _refit_trained(self, s: _StepState) -> None:
        """The engines get the policy this step trained: the next weight version."""
        s.refit_s = self._refit(s.step, version=self.weight_version + 1)
        self.weight_version += 1

    def _refit(self, step: int, *, version: int) -> float:
        """The engines get the actor's weights as ``version``; returns the seconds."""
        self._switch(step, Phase.REFIT)
        start = time.perf_counter()
        with self.trace.span("refit", step=step, phase="refit"):
            self.generation.refit(version=version)
        return time.perf_counter() - start

    def _critic_train(
        self, s: _StepState, batch: StepBatch, *, colocated: bool
    ) -> dict[str, float]:
        """critic_ppo_epochs epochs over the step batch (frozen returns and old values).
        Colocated (the engines released since the batch was generated): the refit
        follows, both trainers sleep, and the engines take the devices back."""
        ppo = self.cfg.ppo
        self._maybe_fail("before_critic", s.step)
        per_rank = ppo.critic_mini_batch_size // self.critic.dp_size  # divides: validate
        # the same global mini-batches whatever the data-parallel size
        order = mini_batch_order(batch.size, self.critic.dp_size, per_rank)
        frozen = {"returns": batch.need("returns"), "old_values": batch.need("old_values")}
        out = self._call(
            Role.CRITIC,
            Phase.CRITIC_TRAIN,
            "train",
            s.step,
            rows=Rows({k: v[order] for k, v in batch.model_inputs().items()}),
            per_sample={k: v[order] for k, v in frozen.items()},
            epochs=ppo.critic_ppo_epochs,
            mini_batch_size=per_rank,
        )
        if colocated:
            if s.policy:
                self._refit_trained(s)
            self._trainers_asleep(s.step)
            self._resume_engines()
        summed = out.summed()
        return {k: v / len(out.values) for k, v in summed.items()}

    # ---------------------------------------------------------------- residency
    def _release_engines(self) -> None:
        """Colocated: the engines stop and release their memory (before a trainer model
        is woken); a no-op when they already did, or generation has its own devices."""
        if self.colocated and not self.engines_released:
            self.generation.pause()
            self.engines_released = True

    def _resume_engines(self) -> None:
        """Colocated: the engines take their memory back and generate (no trainer model
        is resident: :meth:`_trainers_asleep` first)."""
        if self.engines_released:
            assert self.planner.resident is None, self.planner
            self.generation.resume()
            self.engines_released = False

    def _trainers_asleep(self, step: int) -> None:
        """Colocated, between steps: the resident model (if any) sleeps with all its
        parts (the planner's ``release_all``), leaving the devices to the engines."""
        self._execute(self.planner.release_all(), step)

    def _call(
        self,
        role: Role,
        phase: Phase,
        method: str,
        step: int,
        *,
        then: Sequence[Phase] = (),
        **kwargs: Any,
    ) -> GroupResult:
        """One worker call of ``role`` for ``phase``, carrying the plan's transitions."""
        plan = self._plan(role, phase, step, then=then)
        return self._result(self._submit(plan, role, phase, method, step, **kwargs))

    def _plan(self, role: Role, phase: Phase, step: int, *, then: Sequence[Phase] = ()) -> CallPlan:
        """The planner's choice for one call of ``role``; the transitions it puts before
        the call that the call does not carry (the other model's sleep) are queued."""
        plan = self.planner.call(role, phase, then=then)
        for t in plan.before:
            self._queue(t, step)
        return plan

    def _submit(
        self, plan: CallPlan, role: Role, phase: Phase, method: str, step: int, **kwargs: Any
    ) -> _Started:
        """Start the call ``plan`` was made for; it starts once every transition queued
        so far has finished (Ray holds it back; the driver goes on)."""
        deps = list(self._queued)
        pending = self.groups[role].submit(
            method,
            wake_first=plan.wake_parts if plan.wake_first else False,
            sleep_after=plan.sleep_after,
            after=[q.pending for q in deps],
            **kwargs,
        )
        return _Started(pending, deps, step, _PHASE_OF.get(phase, str(phase)))

    def _result(self, started: _Started) -> GroupResult:
        """Wait for a started call; the transitions it waited for are done: trace them."""
        result = started.pending.result()
        self._settle(started.deps)
        self._trace_timeline(result.timeline, started.step, phase=started.phase)
        return result

    def _switch(self, step: int, *phases: Phase, wait: bool = True) -> None:
        """Run the transitions the plan puts before ``phases`` (normally none: calls carry
        them). ``wait=False``: queued (e.g. the actor's sleep and the critic's wake-up
        while the pump waits for the next chunk); the next worker call waits for them."""
        self._execute(self.planner.before(*phases), step, wait=wait)

    def _queue(self, t: Transition, step: int) -> None:
        """Start ``t`` once every transition queued before it has finished: one model's
        sleep always ends before the other's wake-up starts, without the driver waiting."""
        method = "sleep" if t.action is Action.SLEEP else "wake_up"
        after = [q.pending for q in self._queued]
        pending = self.groups[t.role].submit(method, parts=t.parts, after=after)
        self._queued.append(_Queued(pending, str(t), step))

    def _execute(self, transitions: Sequence[Transition], step: int, *, wait: bool = True) -> None:
        """Queue ``transitions`` in order; ``wait``: and wait for everything queued."""
        for t in transitions:
            self._queue(t, step)
        if wait:
            self._settle()

    def _settle(self, done: Sequence[_Queued] | None = None) -> None:
        """Wait for queued transitions (``done``, default all; surfaces their errors)
        and trace them."""
        todo = list(self._queued) if done is None else list(done)
        self._queued = [q for q in self._queued if q not in todo]
        for q in todo:
            result = q.pending.result()
            self._trace_timeline([(q.label, *result.timeline[0][1:])], q.step, "switch")

    def save_models(self, save: Callable[[Role], object], *, step: int) -> None:
        """Checkpoint both models in the plan's order (resident one first), ending with
        the critic resident. Refused inside an update: the checkpoint exclusion covers
        the whole update, from the step's first chunk through critic training."""
        if self.in_update:
            raise RuntimeError(
                f"save_models inside step {self.completed_steps}'s update: a checkpoint "
                "excludes the whole update (through critic training); save between steps"
            )
        self._settle()
        self._release_engines()  # colocated: the models wake on the engines' devices
        for item in self.planner.checkpoint(end_resident=Role.CRITIC):
            if isinstance(item, Work):
                assert item.role is not None
                save(item.role)
            else:
                self._execute([item], step)

    # ---------------------------------------------------------------- generation feed
    def feed_generation(self, timeout_s: float = 0.0) -> int:
        """Let the rollout manager dispatch (lookahead-bounded) and file finished groups."""
        before = time.perf_counter()
        admit = self.completed_steps + (1 if self._policy_ahead else 0)
        ready = self.rollout.pump(trainer_step=admit, timeout_s=timeout_s)
        top = int(getattr(self.rollout, "max_step_dispatched", self.completed_steps))
        for st in range(self.completed_steps, top + 1):  # generation windows open at dispatch
            self._gen_window.setdefault(st, [before, before])
        now = time.perf_counter()
        for gid in ready:
            window = self._gen_window.setdefault(self._step_of(int(gid)), [now, now])
            window[1] = now
        return len(ready)

    def _wait_for_chunk(self, step: int) -> tuple[list[int], float]:
        """Block until the sampler releases a chunk of ``step``; returns (ids, seconds waited)."""
        start = time.perf_counter()
        self.feed_generation()
        while True:
            ids = self.gate.take(trainer_version=self.weight_version)
            if ids:
                end = time.perf_counter()
                if end - start > 1e-3:
                    self.trace.add("wait", start_s=start, end_s=end, step=step, phase="wait")
                return ids, end - start
            if self.cfg.async_rl.sampler.evict_stale:
                evicted = self.rollout.redispatch_evicted()
                if evicted:
                    log.info(
                        "step %d: %d stale group(s) evicted and re-dispatched", step, len(evicted)
                    )
            self.feed_generation(timeout_s=max(self.cfg.async_rl.poll_interval_s, 0.001) * 25)

    # ---------------------------------------------------------------- small pieces
    def _maybe_fail(self, point: str, step: int) -> None:
        if self.fail_at == f"{step}:{point}":
            raise InjectedFailure(f"injected failure at step {step}: {point}")

    def _loss_denominator(self, first: ChunkBatch, *, whole_step: bool) -> tuple[float, bool]:
        """The denominator every chunk of the step gets, and whether it is final.

        ``sample``: the step's sample count, known before generation ends (final).
        ``token``: the valid-token count, final only when the first chunk is the whole
        step; when streaming the chunks pass a provisional count and ``finish_step``
        gets the true one (the trainer rescales the accumulated gradients exactly).
        """
        if self.cfg.ppo.loss_agg == "sample":
            return float(self.cfg.samples_per_step), True
        if whole_step:
            return float(first.loss_mask.sum().item()), True
        return float(self.cfg.samples_per_step * self.cfg.rollout.max_new_tokens), False

    def _check_batch(self, batch: StepBatch) -> None:
        """The no-short-batch guard: ``batch_groups`` prompts of exactly
        ``num_generations_per_prompt`` samples each (not just the right totals)."""
        if batch.size != self.cfg.samples_per_step:
            raise AssertionError(
                f"step batch has {batch.size} samples, expected {self.cfg.samples_per_step}: "
                "samples dropped or duplicated"
            )
        prompts, counts = torch.unique(batch.prompt_indices, return_counts=True)
        if len(prompts) != self.cfg.batch_groups:
            raise AssertionError("a group was dropped or duplicated")
        n = self.cfg.ppo.num_generations_per_prompt
        wrong = [(int(p), int(c)) for p, c in zip(prompts, counts, strict=True) if c != n]
        if wrong:
            listed = ", ".join(f"prompt {p} has {c} samples" for p, c in wrong)
            raise AssertionError(
                f"step batch: {listed}; expected {n} (ppo.num_generations_per_prompt) "
                "per prompt: samples moved between groups, dropped or duplicated"
            )

    def _trace_timeline(self, timeline: Timeline, step: int, phase: str) -> None:
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

    def _trace_generation(self, step: int) -> None:
        window = self._gen_window.pop(step, None)
        if window is not None:
            self.trace.add(
                f"generation step {step}",
                start_s=window[0],
                end_s=window[1],
                track="generation (odd steps)" if step % 2 else "generation",
                step=step,
                phase="generation",
            )

    def _step_metrics(
        self,
        s: _StepState,
        batch: StepBatch,
        update: dict[str, float],
        critic: dict[str, float],
        t_step: float,
        switches: int,
    ) -> dict[str, Any]:
        step_s = time.perf_counter() - t_step
        self._trace_generation(s.step)  # in this step's totals: perf/generation_s
        totals = self.trace.take_step_totals()
        out: dict[str, Any] = {
            "step": s.step,
            "weight_version": self.weight_version,
            "rollout/reward_mean": float(batch.sample_rewards.mean()),
            "rollout/reward_max": float(batch.sample_rewards.max()),
            "rollout/response_len_mean": float(batch.loss_mask.sum(dim=1).mean()),
            "rollout/group_len_max": _group_len_max(batch),
            "train/chunks": len(s.chunk_groups),
            "train/chunk_groups": s.chunk_groups,
            "train/switches": self.planner.switches - switches,
            "perf/step_s": step_s,
            "perf/wait_s": s.waited,
            "perf/idle_frac": s.waited / step_s if step_s > 0 else 0.0,
            "perf/refit_s": s.refit_s,
        }
        for phase, seconds in totals.items():
            out.setdefault(f"perf/{phase}_s", seconds)
        if s.policy:  # the actor's passes over this step's samples (1 while streaming)
            counts = self.actor.call("counters").summed()
            done = {k: v - self._counted.get(k, 0.0) for k, v in counts.items()}
            self._counted = counts
            forwards = done.get("policy_forward", 0.0) + done.get("policy_forward_backward", 0.0)
            out["train/actor_forwards_per_sample"] = forwards / batch.size
        if s.chunk_metrics:  # per chunk, as the actor computed them
            for key in _CHUNK_KEYS:
                out[f"chunk/{key.split('/')[-1]}"] = [m.get(key, 0.0) for m in s.chunk_metrics]
            kl = sum(m.get("rollout/kl_engine_trainer_sum", 0.0) for m in s.chunk_metrics)
            out["rollout/kl_engine_trainer"] = kl / max(1.0, batch.valid_tokens())
        out.update(update)
        out.update(critic)
        check_finite_metrics(s.step, out)
        return out


_PHASE_OF = {
    Phase.VALUE_FORWARD: "value",
    Phase.POLICY_FORWARD: "logprob",
    Phase.POLICY_BACKWARD: "backward",
    Phase.POLICY_UPDATE: "update",
    Phase.CRITIC_TRAIN: "critic",
    Phase.REFIT: "export",  # the actor's weights read between steps (the HF export)
}


def _group_len_max(batch: StepBatch) -> list[int]:
    """Each group's longest response in tokens, in group-id order: when the group was
    done generating (``ppo-driver simulate`` fits its length model on them)."""
    lengths = batch.loss_mask.sum(dim=1)
    groups, index = torch.unique(batch.prompt_indices, return_inverse=True)
    longest = torch.zeros(len(groups), dtype=lengths.dtype).scatter_reduce(
        0, index, lengths, reduce="amax"
    )
    return [int(x) for x in longest.tolist()]


def _moments(valid: Sequence[torch.Tensor]) -> Moments:
    """The statistics of a step's valid raw advantages, taken in the step batch's order
    (the chunks' concatenation: the same numbers in the same order as one full batch)."""
    values = torch.cat(list(valid))[None] if valid else torch.zeros(1, 0)
    return masked_moments(values=values, mask=torch.ones_like(values))


def check_finite_metrics(step: int, metrics: Mapping[str, Any]) -> None:
    """Refuse a step whose numbers are not all finite (a NaN or inf is never dropped or
    written as a gap): raises :class:`NonFiniteError` naming the step and every key
    (list values, e.g. per-chunk numbers, are checked element by element)."""
    bad = {k: v for k, v in _numbers(metrics) if not math.isfinite(v)}
    if bad:
        listed = ", ".join(f"{k} = {v!r}" for k, v in sorted(bad.items()))
        raise NonFiniteError(step, f"non-finite metric(s): {listed}; the step is not recorded")


def _numbers(metrics: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    for k, v in metrics.items():
        values = v if isinstance(v, list) else [v]
        for i, x in enumerate(values):
            if isinstance(x, int | float) and not isinstance(x, bool):
                yield (k if len(values) == 1 and not isinstance(v, list) else f"{k}[{i}]"), x
