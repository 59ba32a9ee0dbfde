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

Full batch is this schedule with one chunk: its epoch 1 is also one optimizer step over
the whole batch, so its forward gives the old log-probs too (no separate pass).

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

The pump owns the schedule: which phase comes next, when to refit, when a checkpoint may
be taken. Who is resident when is decided in one place, the :class:`ppo_driver.pair.TrainPair`
(``ppo_lifecycle.ResidencyPlanner``, whose choice travels inside each worker call as
``wake_first`` / ``sleep_after``). The workers own the mechanism.

Log lines (the document's way to verify chunking), for every chunk and every step::

    train_pump: step <S> chunk <K>: <G> groups, <N> samples
    train_pump: step <S> closing on <K> chunk(s)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from ppo_lifecycle import Phase, Role
from ppo_sampler import Sampler
from ppo_trainer import Moments, gae, masked_moments, masked_whiten, whiten_with

from ppo_driver.batch import ChunkBatch, StepBatch
from ppo_driver.config import DriverConfig
from ppo_driver.metrics import NonFiniteError, check_finite_metrics
from ppo_driver.pair import Metrics, Started, TrainPair
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import Pending, Rows, mini_batch_order

if TYPE_CHECKING:
    from ray import ObjectRef

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


class ChunkGate:
    """The pump's selection logic over the real sampler (no Ray, no tensors).

    ``take`` claims the next chunk of the current step (``[]``: wait). Tail-aware
    deferral, alignment and eligibility are the sampler's (``ppo_sampler``); the gate
    tracks what this step still needs.
    """

    def __init__(
        self,
        sampler: Sampler,
        *,
        batch: int,
        min_groups: int,
        alignment: int,
        merge_blocks: bool = False,
    ) -> None:
        self.sampler = sampler
        self.batch = batch
        self.min_groups = min_groups
        self.alignment = alignment
        # deterministic chunks: every fixed block that is ready goes into one chunk (one
        # call per model; ``merges_ready_blocks`` says when that changes no bit)
        self.merge_blocks = merge_blocks
        self.step = 0
        self.claimed_this_step: list[int] = []
        self.blocks: list[int] = []  # the group count of each block of the last take

    def begin_step(self, step: int) -> None:
        self.step = step
        self.claimed_this_step = []

    @property
    def remaining(self) -> int:
        return self.batch - len(self.claimed_this_step)

    def take(self, *, trainer_version: int) -> list[int]:
        """The groups of the next chunk (``[]``: none ready); :attr:`blocks` says how
        many of them each selected block holds, in order."""
        ids: list[int] = []
        self.blocks = []
        while self.remaining > 0:
            block = [
                int(g)
                for g in self.sampler.select(
                    trainer_step=self.step,
                    trainer_version=trainer_version,
                    remaining=self.remaining,
                    min_groups=self.min_groups,
                    alignment=self.alignment,
                )
            ]
            self.claimed_this_step.extend(block)
            ids.extend(block)
            if block:
                self.blocks.append(len(block))
            if not (block and self.merge_blocks):
                break
        return ids

    def finish_step(self) -> list[int]:
        """This step's groups, to release after both updates."""
        ids = self.claimed_this_step
        self.claimed_this_step = []
        return ids


def merges_ready_blocks(cfg: DriverConfig) -> bool:
    """Whether the blocks of fixed chunks that are ready go into one chunk
    (``async_rl.merge_ready_blocks``).

    That changes no bit: the group alignment makes every block but the last whole
    micro-batches of both models on every data-parallel rank (a null micro-batch size
    is one rank's share of a block), each rank gets its share of every block of a chunk
    in block order (``Rows(blocks=...)``), as one chunk per block would give it, and the
    trainers compute each micro-batch alike in any chunk (cut to its own width)."""
    return cfg.fixed_chunks and cfg.async_rl.merge_ready_blocks


class RolloutLink(Protocol):
    """What the pump needs from the rollout manager (``ppo_driver.rollout.RolloutManager``)."""

    def pump(
        self,
        *,
        trainer_step: int,
        timeout_s: float = 0.0,
        wake_on: Sequence[ObjectRef[Any]] = (),
    ) -> list[int]:
        """Dispatch what the sampler admits, wait up to ``timeout_s`` (or until a call of
        ``wake_on`` ends), file finished groups (replay buffer + ``sampler.add``);
        returns the ids that became ready."""
        ...

    @property
    def groups_in_flight(self) -> int:
        """Groups dispatched and not yet back."""
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

    def take_generate_calls(self, step: int) -> int:
        """The engine calls that carried groups of ``step`` (``rollout.groups_per_call``
        groups each); forgets the count."""
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


@dataclass
class _StepState:
    """What one step gathers while it runs (the pump itself keeps only counters)."""

    step: int
    policy: bool  # False in critic warm-up: no policy work at all
    denominator: float = 0.0
    final: bool = True  # the denominator is the true count (else finish_step gets it)
    chunks: list[ChunkBatch] = field(default_factory=list)
    chunk_groups: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the current chunk's fixed blocks' rows
    chunk_metrics: list[dict[str, float]] = field(default_factory=list)
    # the last chunk's training call, awaited once the update behind it is started
    last_trained: Started[Metrics] | None = None
    waited: float = 0.0
    refit_s: float = 0.0
    raw_advantages: list[torch.Tensor] = field(default_factory=list)  # valid ones, per chunk


# Per chunk, summed over the data-parallel ranks: both are sums over the chunk's tokens
# (each rank's loss already divided by the step's denominator). Not the actor's clip
# fraction or approx KL: epoch 1 takes its old log-probs from its own forward, so both
# are 0 by construction (the step's, over all its epochs, are in the update's metrics).
_CHUNK_KEYS = ("actor/valid_tokens", "loss/pg")


class TrainPump:
    """Drives the two models (a :class:`TrainPair`) and the rollout side through PPO
    steps.

    The first step expects the pair started (``TrainPair.start``: the actor asleep, the
    critic resident) and colocated engines released (they start so). The pump keeps the
    schedule, the chunk gate, the generation feed and the metrics; every worker call and
    residency switch is the pair's.
    """

    def __init__(
        self,
        cfg: DriverConfig,
        *,
        pair: TrainPair,
        rollout: RolloutLink,
        generation: GenerationControl,
        sampler: Sampler,
        pad_id: int,
        trace: TraceRecorder,
        fail_at: str | None = None,
        step_of: Callable[[int], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pair = pair
        self.rollout, self.generation = rollout, generation
        self.gate = ChunkGate(
            sampler,
            batch=cfg.batch_groups,
            min_groups=cfg.min_groups,
            alignment=cfg.group_alignment,
            merge_blocks=merges_ready_blocks(cfg),
        )
        self.pad_id = pad_id
        self.trace = trace
        self.completed_steps = 0
        self.weight_version = 0
        self.fail_at = fail_at
        self.in_update = False
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
        return self.pair.export_policy(step=self.completed_steps)

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
        t_step, switches = time.perf_counter(), self.pair.switches
        self.trace.take_step_totals()
        self.gate.begin_step(step)
        if colocated:  # generation's turn on the devices: no trainer model stays there
            self.pair.release_all(step)
            self._resume_engines()
        self.feed_generation()
        if not colocated:
            self.pair.before(step, Phase.WAIT, Phase.VALUE_FORWARD)  # the critic, before the wait
        while self.gate.remaining > 0:
            chunk = self._next_chunk(s)
            if colocated and self.gate.remaining == 0:  # generated: the trainers' turn
                self._release_engines()
            with self.trace.span(f"chunk {len(s.chunks)}", step=step, phase="chunk"):
                self._train_chunk(s, chunk, more=self.gate.remaining > 0)
            if self.gate.remaining > 0:  # the critic wakes while the pump waits
                self.pair.before(step, Phase.WAIT, Phase.VALUE_FORWARD, wait=False)
        self.pair.settle()
        log.info("train_pump: step %d closing on %d chunk(s)", step, len(s.chunks))
        self._maybe_fail("after_chunks", step)
        # the update needs nothing but the chunks the actor ranks hold, so it starts
        # before the driver assembles and checks the step batch
        started: list[Started[Metrics]] = []
        if s.policy:
            started = self._start_update(s)
        batch = StepBatch.assemble(s.chunks, pad_id=self.pad_id, group_sizes=s.chunk_groups)
        self._check_batch(batch)

        update: dict[str, float] = {}
        if s.policy:  # one optimizer + scheduler update per policy epoch
            # in order: the last chunk's own refusal first, then each update's
            if s.last_trained is not None:
                s.chunk_metrics.append(s.last_trained.result().summed())
            for call in started:
                update = call.result().reduced()
            self._maybe_fail("after_policy_update", step)
            if not colocated:
                self._refit_trained(s)  # early refit: before critic training
        if not colocated:  # the next step's generation overlaps critic training: it is
            self._policy_ahead = True  # dispatched once the critic's calls are queued
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
        s.blocks = self._block_rows(ids, chunk)
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
        """Value forward, GAE, and (after the critic's warm-up) the actor's forward +
        backward: one call per model; the tokens go to Ray's object store once for both.

        While streaming, no switch waits on the driver: the critic's sleep is queued
        behind its forward (it runs while the driver computes GAE, and the actor's call
        starts when it ends), and after a chunk that is not the last the actor stays
        resident; its sleep and the critic's wake-up are queued for the wait. The last
        chunk's call is awaited only after the update behind it is started
        (``_StepState.last_trained``)."""
        ppo = self.cfg.ppo
        rows = Rows(chunk.model_inputs(), blocks=s.blocks)
        if s.policy:  # not in critic warm-up
            after_values: tuple[Phase, ...] = ()
        elif more:
            after_values = (Phase.WAIT, Phase.VALUE_FORWARD)
        else:
            after_values = (Phase.CRITIC_TRAIN,)
        values = self.pair.values(rows, step=s.step, then=after_values)
        if s.policy:  # queues the critic's sleep now, behind its forward
            then = () if more else (Phase.POLICY_UPDATE,)
            actor_plan = self.pair.plan(Role.ACTOR, Phase.POLICY_BACKWARD, s.step, then=then)
        chunk.old_values = values.result().tensor()
        advantages, chunk.returns = gae(
            rewards=chunk.rewards,
            values=chunk.old_values,
            mask=chunk.loss_mask,
            gamma=ppo.adv_estimator.gamma,
            lam=ppo.adv_estimator.lam,
        )
        chunk.advantages = self._normalize(s, advantages, chunk.loss_mask)
        if s.policy:
            trained = self.pair.train_chunk(
                actor_plan,
                rows,
                advantages=chunk.advantages,
                engine_logprobs=chunk.engine_logprobs,
                loss_denominator=s.denominator,
                keep=ppo.ppo_epochs > 1,  # the rank keeps the chunk for epochs 2..K
            )
            if more:
                s.chunk_metrics.append(trained.result().summed())
            else:  # the update queues behind it on the actor ranks without waiting here
                s.last_trained = trained
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
    def _start_update(self, s: _StepState) -> list[Started[Metrics]]:
        """After epoch 1's chunks: its optimizer step, then epochs 2..K over the chunks
        the actor ranks kept, each with its step; started, not awaited (the actor runs
        them in order; the last call's result is the last update's metrics). A
        token-mean loss whose chunks got a provisional denominator gets the step's true
        valid-token count here."""
        final = None
        if not s.final:
            final = float(sum(float(c.loss_mask.sum().item()) for c in s.chunks))
        calls = [self.pair.finish_step(step=s.step, loss_denominator=final)]
        epochs = self.cfg.ppo.ppo_epochs - 1
        if epochs:
            calls.append(
                self.pair.train_epochs(
                    step=s.step,
                    epochs=epochs,
                    loss_denominator=s.denominator if final is None else final,
                )
            )
        return calls

    def _refit_trained(self, s: _StepState) -> None:
        """The engines get the policy this step trained: the next weight version."""
        s.refit_s = self._refit(s.step, version=self.weight_version + 1)
        self.weight_version += 1

    def _refit(self, step: int, *, version: int) -> float:
        """The engines get the actor's weights as ``version``; returns the seconds."""

        def push() -> float:  # once the plan has made the actor resident
            start = time.perf_counter()
            with self.trace.span("refit", step=step, phase="refit"):
                self.generation.refit(version=version)
            return time.perf_counter() - start

        return self.pair.refit(step, push)

    def _critic_train(
        self, s: _StepState, batch: StepBatch, *, colocated: bool
    ) -> dict[str, float]:
        """critic_ppo_epochs epochs over the step batch (frozen returns and old values).
        Colocated (the engines released since the batch was generated): the refit
        follows, both trainers sleep, and the engines take the devices back."""
        ppo = self.cfg.ppo
        self._maybe_fail("before_critic", s.step)
        dp_size = self.pair.critic.dp_size
        per_rank = ppo.critic_mini_batch_size // dp_size  # divides: validate
        # the same global mini-batches whatever the data-parallel size
        order = mini_batch_order(batch.size, dp_size, per_rank)
        out = self.pair.train_critic(
            Rows({k: v[order] for k, v in batch.model_inputs().items()}),
            step=s.step,
            returns=batch.need("returns")[order],
            old_values=batch.need("old_values")[order],
            epochs=ppo.critic_ppo_epochs,
            mini_batch_size=per_rank,
            meanwhile=None if colocated else self._feed_while,
        )
        if colocated:
            if s.policy:
                self._refit_trained(s)
            self.pair.release_all(s.step)
            self._resume_engines()
        return out

    # ---------------------------------------------------------------- residency
    def _release_engines(self) -> None:
        """Colocated: the engines stop and release their memory (before a trainer model
        is woken); a no-op when they already did, or generation has its own devices."""
        if self.colocated and not self.engines_released:
            self.generation.pause()
            self.engines_released = True

    def _resume_engines(self) -> None:
        """Colocated: the engines take their memory back and generate (no trainer model
        is resident: ``TrainPair.release_all`` first)."""
        if self.engines_released:
            assert self.pair.resident is None, self.pair.planner
            self.generation.resume()
            self.engines_released = False

    def save_models(self, directory: Path, *, step: int) -> None:
        """Checkpoint both models under ``directory`` (``actor/``, ``critic/``) in the
        plan's order (resident one first), ending with the critic resident. Refused
        inside an update: the checkpoint exclusion covers the whole update, from the
        step's first chunk through critic training."""
        if self.in_update:
            raise RuntimeError(
                f"save_models inside step {self.completed_steps}'s update: a checkpoint "
                "excludes the whole update (through critic training); save between steps"
            )
        self.pair.settle()
        self._release_engines()  # colocated: the models wake on the engines' devices
        self.pair.save(directory, step=step)

    # ---------------------------------------------------------------- generation feed
    def feed_generation(
        self, timeout_s: float = 0.0, *, wake_on: Sequence[ObjectRef[Any]] = ()
    ) -> int:
        """Let the rollout manager dispatch (lookahead-bounded) and file finished groups."""
        before = time.perf_counter()
        admit = self.completed_steps + (1 if self._policy_ahead else 0)
        ready = self.rollout.pump(trainer_step=admit, timeout_s=timeout_s, wake_on=wake_on)
        top = int(getattr(self.rollout, "max_step_dispatched", self.completed_steps))
        for st in range(self.completed_steps, top + 1):  # generation windows open at dispatch
            self._gen_window.setdefault(st, [before, before])
        now = time.perf_counter()
        for gid in ready:
            window = self._gen_window.setdefault(self._step_of(int(gid)), [now, now])
            window[1] = now
        return len(ready)

    def _feed_while(self, call: Pending[object]) -> None:
        """Dispatch the next step's generation, then file the groups that finish while
        ``call`` runs (critic training overlapping that generation): the driver would
        otherwise only wait, and collect and score them after it, on the next step's
        critical path. The dispatch (one engine call per group) follows the critic's
        calls, so the critic does not wait for it."""
        self.feed_generation()
        while self.rollout.groups_in_flight and not call.done():
            self.feed_generation(timeout_s=self._poll_s, wake_on=call.refs)

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
            self.feed_generation(timeout_s=self._poll_s)

    def _block_rows(self, ids: Sequence[int], chunk: ChunkBatch) -> list[int]:
        """The rows of each fixed block in a chunk of several (none for one block), in
        the chunk's row order. ``RolloutManager.claim`` orders the groups as they were
        filed (by prompt index, or by longest response with ``block_order: length``),
        which is the order the sampler took them in: so each block is a run of rows."""
        sizes = self.gate.blocks
        if len(sizes) < 2:
            return []
        rows = chunk.prompt_indices.tolist()
        n = self.cfg.ppo.num_generations_per_prompt
        if rows[::n] != list(ids):
            raise AssertionError(f"the chunk's groups {rows[::n]} are not in the order taken {ids}")
        return [size * n for size in sizes]

    # ---------------------------------------------------------------- small pieces
    @property
    def _poll_s(self) -> float:
        """The longest wait for a generation result before checking again."""
        return max(self.cfg.async_rl.poll_interval_s, 0.001) * 25

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
            "rollout/generate_calls": self.rollout.take_generate_calls(s.step),
            "train/chunks": len(s.chunk_groups),
            "train/chunk_groups": s.chunk_groups,
            "train/chunk_widths": [c.width for c in s.chunks],  # padded tokens of a row
            "train/switches": self.pair.switches - switches,
            "perf/step_s": step_s,
            "perf/wait_s": s.waited,
            "perf/idle_frac": s.waited / step_s if step_s > 0 else 0.0,
            "perf/refit_s": s.refit_s,
        }
        for phase, seconds in totals.items():
            out.setdefault(f"perf/{phase}_s", seconds)
        if s.policy:  # the actor's passes over this step's samples (K: one per epoch)
            counts = self.pair.actor_counters()
            done = {k: v - self._counted.get(k, 0.0) for k, v in counts.items()}
            self._counted = counts
            forwards = done.get("policy_forward", 0.0) + done.get("policy_forward_backward", 0.0)
            out["train/actor_forwards_per_sample"] = forwards / batch.size
            if self.cfg.ppo.kl_loss_coef > 0:  # the reference model's (once a step)
                out["train/reference_forwards_per_sample"] = (
                    done.get("reference_forward", 0.0) / batch.size
                )
        if s.chunk_metrics:  # per chunk, as the actor computed them
            for key in _CHUNK_KEYS:
                out[f"chunk/{key.split('/')[-1]}"] = [m.get(key, 0.0) for m in s.chunk_metrics]
            kl = sum(m.get("rollout/kl_engine_trainer_sum", 0.0) for m in s.chunk_metrics)
            out["rollout/kl_engine_trainer"] = kl / max(1.0, batch.valid_tokens())
        out.update(update)
        out.update(critic)
        check_finite_metrics(s.step, out)
        return out


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
