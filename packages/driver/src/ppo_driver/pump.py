"""The train pump: one PPO step at a time, streaming chunks as generation finishes them.

Reads top to bottom like the schedule in DESIGN.md (``run_step``). The pump owns the
plan: which model is resident when (``_Residency``), when to refit, when a checkpoint may
be taken. The workers own the mechanism (``sleep``/``wake_up``, backward, updates).

Log lines (the document's way to verify chunking), for every chunk and every step::

    train_pump: step <S> chunk <K>: <G> groups, <N> samples
    train_pump: step <S> closing on <K> chunk(s)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ppo_driver.config import DriverConfig
from ppo_driver.trace import TraceRecorder

__all__ = [
    "ChunkGate",
    "InjectedFailure",
    "NonFiniteError",
    "RolloutLink",
    "StepReport",
    "TrainPump",
    "assemble_full_batch",
    "check_finite_metrics",
    "step_prompt_indices",
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


# ------------------------------------------------------------------- pure helpers


def step_prompt_indices(step: int, *, batch: int) -> range:
    """The global prompt indices (= group ids) of step ``step``: fixed, so a resumed run
    dispatches exactly the prompts it had not finished, nothing twice."""
    return range(step * batch, (step + 1) * batch)


class ChunkGate:
    """The pump's selection logic over the real sampler (no Ray, no tensors).

    ``offer`` hands it finished groups; ``take`` claims the next chunk of the current
    step (``[]``: wait). Tail-aware deferral, alignment and eligibility are the
    sampler's (``ppo_sampler``); the gate tracks what this step still needs.
    """

    def __init__(self, sampler: Any, *, batch: int, min_groups: int, alignment: int) -> None:
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


def _pad_to(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def assemble_full_batch(
    chunks: Sequence[dict[str, torch.Tensor]], *, pad_id: int, order_key: str = "prompt_indices"
) -> dict[str, torch.Tensor]:
    """Concatenate chunk tensors (``[b_k, T_k]`` -> ``[B, T]``, right padded) and sort the
    rows by ``order_key`` so the assembled batch does not depend on chunk boundaries."""
    width = max(int(c["input_ids"].shape[1]) for c in chunks)
    keys = list(chunks[0])
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        fill = float(pad_id) if key == "input_ids" else 0.0
        out[key] = torch.cat([_pad_to(c[key], width, fill) for c in chunks], dim=0)
    order = torch.argsort(out[order_key], stable=True)
    return {k: v[order] for k, v in out.items()}


# ------------------------------------------------------------------- rollout side


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

    def refit(self, *, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


# ------------------------------------------------------------------- residency plan


class _Residency:
    """Which model holds the training devices, driven by ``ppo_lifecycle.plan_transitions``.

    Before each phase the pump asks the lifecycle plan for the transitions that phase
    needs (none when the right model is already resident: no redundant switch, also
    across empty selections) and executes them on the worker groups; every switch is
    traced. The actor sleeps keeping its gradients while it holds un-applied ones.
    """

    def __init__(self, actor: Any, critic: Any, trace: TraceRecorder) -> None:
        from ppo_lifecycle import Role

        self.groups = {Role.ACTOR: actor, Role.CRITIC: critic}
        self.trace = trace
        self.resident: Any = None
        self.pending_gradients = False
        self.switches = 0

    def start(self) -> None:
        """Both models come up resident: put the actor fully to sleep, the critic first."""
        from ppo_lifecycle import ALL_PARTS, Role

        self.groups[Role.ACTOR].call("sleep", parts=ALL_PARTS)
        self.groups[Role.CRITIC].call("wake_up")
        self.resident = Role.CRITIC

    def plan(self, *phases: Any) -> list[Any]:
        """The transitions the lifecycle plan puts before ``phases`` (only the first
        phase's work follows; later phases only say what a WAIT prepares for), taken as
        done: the caller executes them (:meth:`execute`, or fused into worker calls)."""
        from ppo_lifecycle import Phase, Transition, Work, plan_transitions

        plan = plan_transitions(
            list(phases),
            resident=self.resident,
            pending_gradients=self.pending_gradients,
            end_resident=None,
        )
        out: list[Any] = []
        for item in plan:
            if isinstance(item, Work):
                break
            assert isinstance(item, Transition)
            out.append(item)
            self._taken(item)
        if phases[0] is Phase.POLICY_BACKWARD:
            self.pending_gradients = True
        elif phases[0] is Phase.POLICY_UPDATE:
            self.pending_gradients = False
        return out

    def _taken(self, item: Any) -> None:
        """Account for a transition as done (a wake-up makes its role resident)."""
        from ppo_lifecycle import Action

        if item.action is Action.WAKE_UP:
            self.resident = item.role
            self.switches += 1

    def execute(self, transitions: Sequence[Any], *, step: int) -> None:
        """Run planned transitions one Ray call each, in order, each traced."""
        from ppo_lifecycle import Action

        for item in transitions:
            with self.trace.span(f"{item}", phase="switch", step=step):
                if item.action is Action.SLEEP:
                    self.groups[item.role].call("sleep", parts=item.parts)
                else:
                    self.groups[item.role].call("wake_up")

    def prepare(self, *phases: Any, step: int) -> None:
        """Plan and execute the transitions before ``phases`` (see :meth:`plan`)."""
        self.execute(self.plan(*phases), step=step)

    @staticmethod
    def as_ops(transitions: Sequence[Any]) -> list[Any]:
        """Transitions as worker calls to fuse into a group's Ray call."""
        from ppo_lifecycle import Action

        from ppo_driver.workers import Op

        return [
            Op("sleep", kwargs={"parts": t.parts}, label=f"{t}", phase="switch")
            if t.action is Action.SLEEP
            else Op("wake_up", label=f"{t}", phase="switch")
            for t in transitions
        ]

    def fused(self, *phases: Any, after: Any, step: int) -> tuple[list[Any], list[Any]]:
        """Plan the transitions before ``phases`` as worker ops to fuse: (those joining
        the call of ``after``, those leading the other role's next call). A plan of
        another shape is executed on its own here, one call each, and gives no ops."""
        transitions = self.plan(*phases)
        parts = self.split(transitions, after=after)
        if parts is None:
            self.execute(transitions, step=step)
            return [], []
        return self.as_ops(parts[0]), self.as_ops(parts[1])

    def split(
        self, transitions: Sequence[Any], *, after: Any
    ) -> tuple[list[Any], list[Any]] | None:
        """Split planned transitions for fusing: those of ``after`` (the role whose work
        precedes them) join its call, the rest lead the other role's next call.
        ``None`` when the plan does not have that shape (execute it on its own)."""
        k = 0
        while k < len(transitions) and transitions[k].role == after:
            k += 1
        lead, follow = list(transitions[:k]), list(transitions[k:])
        if any(t.role == after for t in follow):
            return None
        return lead, follow

    def save_both(self, save: Callable[[str], object], *, step: int) -> None:
        """Checkpoint both models in the plan's order (resident one first), ending with
        the critic resident. Refused by the plan inside an update."""
        from ppo_lifecycle import Phase, Role, Transition, Work, plan_transitions

        plan = plan_transitions(
            [Phase.CHECKPOINT_SAVE],
            resident=self.resident,
            pending_gradients=self.pending_gradients,
            end_resident=Role.CRITIC,
        )
        for item in plan:
            if isinstance(item, Work):
                assert item.role is not None
                save(str(item.role))
                continue
            assert isinstance(item, Transition)
            self.execute([item], step=step)
            self._taken(item)


# ------------------------------------------------------------------- the pump


@dataclass
class StepReport:
    step: int
    chunk_groups: list[int]
    group_ids: list[int]
    metrics: dict[str, Any] = field(default_factory=dict)


class TrainPump:
    """Drives the actor group, the critic group and the rollout side through PPO steps."""

    def __init__(
        self,
        cfg: DriverConfig,
        *,
        actor: Any,
        critic: Any,
        rollout: RolloutLink,
        generation: GenerationControl,
        sampler: Any,
        alignment: int,
        pad_id: int,
        trace: TraceRecorder,
        gae: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        whiten: Callable[..., torch.Tensor],
        completed_steps: int = 0,
        weight_version: int = 0,
        fail_at: str | None = None,
        step_of: Callable[[int], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor, self.critic = actor, critic
        self.rollout, self.generation = rollout, generation
        self.gate = ChunkGate(
            sampler, batch=cfg.batch_groups, min_groups=cfg.min_groups, alignment=alignment
        )
        self.pad_id = pad_id
        self.trace = trace
        self.gae, self.whiten = gae, whiten
        self.residency = _Residency(actor, critic, trace)
        self.completed_steps = completed_steps
        self.weight_version = weight_version
        self.fail_at = fail_at
        self.in_update = False
        self._pending: tuple[Any, list[Any], list[Any], int] | None = None
        # True once this step's policy is final on the engines (after the early refit):
        # the next step's prompts may then be dispatched, overlapping critic training.
        self._policy_ahead = False
        self._switches_before = 0
        self._gen_window: dict[int, list[float]] = {}  # step -> [first poll, last arrival]
        self._step_of: Callable[[int], int] = step_of or (lambda gid: gid // cfg.batch_groups)

    # ---------------------------------------------------------------- generation feed
    def feed_generation(self, timeout_s: float = 0.0) -> int:
        """Let the rollout manager dispatch (lookahead-bounded) and file finished groups."""
        before = time.perf_counter()
        admit = self.completed_steps + (1 if self._policy_ahead else 0)
        ready = self.rollout.pump(trainer_step=admit, timeout_s=timeout_s)
        top = int(getattr(self.rollout, "max_step_dispatched", self.completed_steps))
        for s in range(self.completed_steps, top + 1):  # generation windows open at dispatch
            self._gen_window.setdefault(s, [before, before])
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

    def _maybe_fail(self, point: str, step: int) -> None:
        if self.fail_at == f"{step}:{point}":
            raise InjectedFailure(f"injected failure at step {step}: {point}")

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
        from ppo_lifecycle import Phase

        cfg, ppo = self.cfg, self.cfg.ppo
        warmup = step < ppo.critic_warmup_steps  # critic warm-up: no policy work at all
        colocated_full_batch = cfg.cluster.colocate and not cfg.streaming
        full_batch_epochs = not cfg.streaming and ppo.ppo_epochs > 1
        t_step = time.perf_counter()
        self._switches_before = self.residency.switches
        self.trace.take_step_totals()
        self.gate.begin_step(step)
        self.feed_generation()

        chunks: list[dict[str, torch.Tensor]] = []
        chunk_groups: list[int] = []
        actor_metrics: list[dict[str, float]] = []
        waited = 0.0
        kl_sum = 0.0  # engine vs trainer log-probs of the sampled tokens (policy lag)
        denominator, final = 0.0, True
        # The value model is prepared before waiting for the first chunk.
        self.residency.prepare(Phase.WAIT, Phase.VALUE_FORWARD, step=step)
        while self.gate.remaining > 0:
            ids, w = self._wait_for_chunk(step)
            waited += w
            self.in_update = True  # checkpoint exclusion covers the whole update
            batch = self.rollout.claim(ids)
            if not chunks:
                denominator, final = self._loss_denominator(
                    batch, whole_step=len(ids) == cfg.batch_groups
                )
            k = len(chunks) + 1
            log.info(
                "train_pump: step %d chunk %d: %d groups, %d samples",
                step,
                k,
                len(ids),
                batch["input_ids"].shape[0],
            )
            with self.trace.span(f"chunk {k}", step=step, phase="chunk", args={"groups": len(ids)}):
                chunk_metrics = self._train_chunk(
                    batch,
                    step=step,
                    policy=not warmup,
                    backward=not full_batch_epochs,
                    denominator=denominator,
                    more_chunks=self.gate.remaining > 0,
                )
                if not warmup:
                    kl_sum += _engine_kl_sum(batch)
                if chunk_metrics is not None:
                    actor_metrics.append(chunk_metrics)
            chunks.append(batch)
            chunk_groups.append(len(ids))
            if self.gate.remaining > 0:
                # prepare the value model before waiting; it stays across empty selections
                self.residency.prepare(Phase.WAIT, Phase.VALUE_FORWARD, step=step)
        self._settle()
        log.info("train_pump: step %d closing on %d chunk(s)", step, len(chunks))
        self._maybe_fail("after_chunks", step)

        full = assemble_full_batch(chunks, pad_id=self.pad_id)
        assert int(full["input_ids"].shape[0]) == cfg.samples_per_step, (
            "samples dropped or duplicated"
        )
        assert len(set(full["prompt_indices"].tolist())) == cfg.batch_groups, (
            "a group was dropped or duplicated"
        )

        # actor: ONE optimizer + scheduler update (full-batch mode: one per policy epoch)
        update_metrics: dict[str, float] = {}
        refit_s = 0.0
        if not warmup:
            if full_batch_epochs:
                for _ in range(ppo.ppo_epochs):
                    self.residency.prepare(Phase.POLICY_BACKWARD, step=step)
                    with self.trace.span("policy backward", step=step, phase="backward"):
                        actor_metrics.append(self._backward(full, denominator))
                    self.residency.prepare(Phase.POLICY_UPDATE, step=step)
                    with self.trace.span("policy update", step=step, phase="update"):
                        update_metrics = self._finish_step(full, final=final)
            else:
                self.residency.prepare(Phase.POLICY_UPDATE, step=step)
                with self.trace.span("policy update", step=step, phase="update"):
                    update_metrics = self._finish_step(full, final=final)
            self._maybe_fail("after_policy_update", step)
            if not colocated_full_batch:
                self.residency.prepare(Phase.REFIT, step=step)
                refit_s = self._refit(step)  # early refit: before critic training
        if not colocated_full_batch:
            # The engines hold the next step's policy (or, in critic warm-up, the policy
            # did not change): its generation overlaps critic training.
            self._policy_ahead = True
            self.feed_generation()
        # critic: critic_ppo_epochs epochs over the assembled FULL batch, frozen returns/old values
        if colocated_full_batch:
            self.generation.pause()  # generation shares the devices: paused during critic training
        self.residency.prepare(Phase.CRITIC_TRAIN, step=step)
        self._maybe_fail("before_critic", step)
        with self.trace.span("critic training", step=step, phase="critic"):
            critic_metrics = self._critic_train(full)
        if colocated_full_batch:
            if not warmup:
                self.residency.prepare(Phase.REFIT, step=step)
                refit_s = self._refit(step)  # refit follows critic training
            self.generation.resume()
        # release consumed replay rows, then advance the completed-step counter
        ids = self.gate.finish_step()
        self.rollout.release(ids)
        self.completed_steps += 1
        self._policy_ahead = False
        self.in_update = False
        self._maybe_fail("after_step", step)

        step_s = time.perf_counter() - t_step
        totals = self.trace.take_step_totals()
        self._trace_generation(step)
        metrics = self._step_metrics(
            step,
            full,
            chunk_groups,
            actor_metrics,
            update_metrics,
            critic_metrics,
            totals,
            step_s,
            waited,
            refit_s,
        )
        if not warmup:
            metrics["rollout/kl_engine_trainer"] = kl_sum / max(1.0, float(full["loss_mask"].sum()))
        return StepReport(
            step=step, chunk_groups=chunk_groups, group_ids=sorted(ids), metrics=metrics
        )

    # ---------------------------------------------------------------- pieces
    def _train_chunk(
        self,
        batch: dict[str, torch.Tensor],
        *,
        step: int,
        policy: bool,
        backward: bool,
        denominator: float,
        more_chunks: bool,
    ) -> dict[str, float] | None:
        """One chunk, in the document's order, with the switches fused into the model
        calls (one Ray round trip per model and phase group, not one per call):

        1. critic: value forward with the UNCHANGED critic (old values, kept for every
           critic epoch), then it sleeps;  actor (ordered after it): wake, log-prob
           (+ reference) forward;  meanwhile the driver computes GAE;
        2. actor (queued behind its log-prob call, whose results it reads on the worker:
           no driver round trip in between): backward scaled by the WHOLE step's count
           (no optimizer step), then sleeps keeping its gradients;  critic (ordered
           after it): wakes, so the value model is ready before the wait for the next
           chunk.

        Fills ``old_values``, ``advantages``, ``returns`` (and ``old_logprobs``,
        ``ref_logprobs``) in ``batch``; returns the backward's metrics (or ``None``).
        """
        from ppo_lifecycle import Phase, Role

        from ppo_driver.workers import Op, Recall

        ppo = self.cfg.ppo
        res = self.residency
        inputs = _model_inputs(batch)
        rows = int(batch["input_ids"].shape[0])
        self._settle()
        res.prepare(Phase.VALUE_FORWARD, step=step)  # normally nothing: prepared before the wait
        critic_ops = [Op("compute_values", (inputs,), label="value forward", phase="value")]
        actor_ops: list[Op] = []
        if policy:
            critic_leaves, actor_arrives = res.fused(
                Phase.POLICY_FORWARD, after=Role.CRITIC, step=step
            )
            critic_ops += critic_leaves
            actor_ops = [
                *actor_arrives,
                Op("compute_logprobs", (inputs,), label="logprob forward", phase="logprob"),
            ]
            if ppo.kl_loss_coef > 0:
                actor_ops.append(
                    Op("compute_ref_logprobs", (inputs,), label="ref forward", phase="logprob")
                )
        critic_refs = self.critic.submit(critic_ops, rows=rows)
        actor_refs = self.actor.submit(actor_ops, rows=rows, after=critic_refs) if actor_ops else []
        batch["old_values"] = self._collect(self.critic, critic_refs, critic_ops, step)[0]
        # GAE per sample -> advantages, frozen returns; advantages normalised per chunk
        advantages, returns = self.gae(
            rewards=batch["rewards"],
            values=batch["old_values"],
            mask=batch["loss_mask"],
            gamma=ppo.adv_estimator.gamma,
            lam=ppo.adv_estimator.lam,
        )
        if ppo.adv_estimator.normalize_advantages:
            advantages = self.whiten(values=advantages, mask=batch["loss_mask"])
        batch["advantages"], batch["returns"] = advantages, returns
        if not policy:
            return None
        back_ops: list[Op] = []
        critic_after: list[Op] = []
        if backward:
            # queued behind the log-prob call on every rank: it reads the log-probs that
            # call leaves on the worker, so the driver does not wait for them first
            res.execute(res.plan(Phase.POLICY_BACKWARD), step=step)  # normally nothing
            kwargs: dict[str, Any] = {
                "old_logprobs": Recall("compute_logprobs"),
                "advantages": batch["advantages"],
                "loss_denominator": denominator,
            }
            if ppo.kl_loss_coef > 0:
                kwargs["ref_logprobs"] = Recall("compute_ref_logprobs")
            back_ops = [
                Op("backward", (inputs,), kwargs, label="policy backward", phase="backward")
            ]
            if more_chunks:  # prepare the value model before waiting for the next chunk
                actor_leaves, critic_after = res.fused(
                    Phase.WAIT, Phase.VALUE_FORWARD, after=Role.ACTOR, step=step
                )
                back_ops += actor_leaves
        back_refs = self.actor.submit(back_ops, rows=rows) if back_ops else []
        if critic_after:  # not awaited here: it runs while the pump waits for a chunk
            self._pending = (
                self.critic,
                self.critic.submit(critic_after, after=back_refs),
                critic_after,
                step,
            )
        outs = self._collect(self.actor, actor_refs, actor_ops, step)
        batch["old_logprobs"] = outs[-2] if ppo.kl_loss_coef > 0 else outs[-1]
        if ppo.kl_loss_coef > 0:
            batch["ref_logprobs"] = outs[-1]
        if not back_ops:
            return None
        per_rank = self.actor.results(back_refs)
        self._trace_ops(per_rank, back_ops, step)
        return _sum_dicts([rank[0][0] for rank in per_rank])

    def _collect(
        self, group: Any, refs: Sequence[Any], ops: Sequence[Any], step: int
    ) -> list[torch.Tensor]:
        """Wait for a fused call; trace its ops; per op, the ranks' ``[B_r, T]`` rows
        concatenated (``None`` for ops without a result, e.g. sleep/wake)."""
        per_rank = group.results(refs)
        self._trace_ops(per_rank, ops, step)
        out: list[Any] = []
        for i in range(len(ops)):
            parts = [rank[i][0] for rank in per_rank]
            out.append(torch.cat(parts, dim=0) if isinstance(parts[0], torch.Tensor) else None)
        return out

    def _trace_ops(self, per_rank: Sequence[Any], ops: Sequence[Any], step: int) -> None:
        """Rank 0's per-op wall-clock times, placed on the driver's timeline."""
        shift = time.perf_counter() - time.time()
        for op, (_, t0, t1) in zip(ops, per_rank[0], strict=True):
            self.trace.add(
                op.label, start_s=t0 + shift, end_s=t1 + shift, step=step, phase=op.phase
            )

    def _settle(self) -> None:
        """Surface the result (or error) of a fused call left running (the critic's
        wake-up before a wait)."""
        if self._pending is not None:
            group, refs, ops, step = self._pending
            self._pending = None
            self._trace_ops(group.results(refs), ops, step)

    def _loss_denominator(
        self, first_chunk: dict[str, torch.Tensor], *, whole_step: bool
    ) -> tuple[float, bool]:
        """The denominator every ``backward`` of the step gets, and whether it is final.

        ``sample``: the step's sample count, known before generation ends (final).
        ``token``: the valid-token count, final only when the first chunk is the whole
        step; when streaming the chunks pass a provisional count and ``finish_step``
        gets the true one (the trainer rescales the accumulated gradients exactly).
        """
        if self.cfg.ppo.loss_agg == "sample":
            return float(self.cfg.samples_per_step), True
        if whole_step:
            return float(first_chunk["loss_mask"].sum().item()), True
        return float(self.cfg.samples_per_step * self.cfg.rollout.max_new_tokens), False

    def _finish_step(self, full: dict[str, torch.Tensor], *, final: bool) -> dict[str, float]:
        """One optimizer + scheduler update; the true token count when it was provisional."""
        if final:
            out: dict[str, float] = self.actor.call("finish_step")[0]
        else:
            true_count = float(full["loss_mask"].sum().item())
            out = self.actor.call("finish_step", loss_denominator=true_count)[0]
        return out

    def _backward(self, batch: dict[str, torch.Tensor], denominator: float) -> dict[str, float]:
        kwargs: dict[str, Any] = {
            "old_logprobs": batch["old_logprobs"],
            "advantages": batch["advantages"],
            "loss_denominator": denominator,
        }
        if "ref_logprobs" in batch:
            kwargs["ref_logprobs"] = batch["ref_logprobs"]
        per_rank = self.actor.call_sharded("backward", _model_inputs(batch), **kwargs)
        return _sum_dicts(per_rank)

    def _critic_train(self, full: dict[str, torch.Tensor]) -> dict[str, float]:
        per_rank = self.critic.call_sharded(
            "train",
            _model_inputs(full),
            returns=full["returns"],
            old_values=full["old_values"],
            epochs=self.cfg.ppo.critic_ppo_epochs,
            mini_batch_size=max(1, self.cfg.ppo.critic_mini_batch_size // self.critic.world_size),
        )
        return _mean_dicts(per_rank)

    def _refit(self, step: int) -> float:
        start = time.perf_counter()
        with self.trace.span("refit", step=step, phase="refit"):
            self.generation.refit(version=self.weight_version + 1)
        self.weight_version += 1
        return time.perf_counter() - start

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
        step: int,
        full: dict[str, torch.Tensor],
        chunk_groups: list[int],
        actor_metrics: list[dict[str, float]],
        update_metrics: dict[str, float],
        critic_metrics: dict[str, float],
        totals: dict[str, float],
        step_s: float,
        waited: float,
        refit_s: float,
    ) -> dict[str, Any]:
        mask = full["loss_mask"]
        out: dict[str, Any] = {
            "step": step,
            "weight_version": self.weight_version,
            "rollout/reward_mean": float(full["sample_rewards"].mean()),
            "rollout/reward_max": float(full["sample_rewards"].max()),
            "rollout/response_len_mean": float(mask.sum(dim=1).mean()),
            "train/chunks": len(chunk_groups),
            "train/chunk_groups": chunk_groups,
            "train/switches": self.residency.switches - self._switches_before,
            "perf/step_s": step_s,
            "perf/wait_s": waited,
            "perf/idle_frac": waited / step_s if step_s > 0 else 0.0,
            "perf/refit_s": refit_s,
        }
        for phase, seconds in totals.items():
            out.setdefault(f"perf/{phase}_s", seconds)
        del actor_metrics  # per-chunk numbers; the update reports the step's totals
        out.update(update_metrics)
        out.update(critic_metrics)
        check_finite_metrics(step, out)
        return out


def _engine_kl_sum(batch: dict[str, torch.Tensor]) -> float:
    """Sum over response tokens of the k3 estimate of KL(engine || trainer) per token."""
    if "engine_logprobs" not in batch:
        return 0.0
    delta = (batch["old_logprobs"] - batch["engine_logprobs"]).float()
    k3 = torch.exp(delta) - 1.0 - delta
    return float((k3 * batch["loss_mask"]).sum())


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}


def check_finite_metrics(step: int, metrics: Mapping[str, Any]) -> None:
    """Refuse a step whose numbers are not all finite (a NaN or inf is never dropped or
    written as a gap): raises :class:`NonFiniteError` naming the step and every key."""
    bad = {
        k: v
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and not math.isfinite(v)
    }
    if bad:
        listed = ", ".join(f"{k} = {v!r}" for k, v in sorted(bad.items()))
        raise NonFiniteError(step, f"non-finite metric(s): {listed}; the step is not recorded")


def _sum_dicts(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-key sums over ranks or chunks. Non-finite values are kept (the sum is then
    non-finite too) so that :func:`check_finite_metrics` sees them."""
    out: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, int | float):
                out[k] = out.get(k, 0.0) + float(v)
    return out


def _mean_dicts(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    summed = _sum_dicts(rows)
    return {k: v / max(1, len(rows)) for k, v in summed.items()}
