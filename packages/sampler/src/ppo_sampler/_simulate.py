"""A discrete-event model of streaming PPO steps, driven by the package's own gate.

The simulation does not re-implement the chunk decision: every poll asks a real sampler
(:func:`ppo_sampler.make_sampler`, i.e. :class:`InOrderSampler` or
:class:`ReadyFirstSampler` over :func:`plan_chunk`) which groups to train on, exactly as
the driver's pump does. What is modelled is time:

* **generation** (:class:`GenerationModel`): each group's samples get response lengths
  (:class:`LognormalLengths` or :class:`MeasuredLengths`); a group is done when its
  longest sample is. An engine decodes ``concurrency`` sequences at ``tokens_per_s``
  in all, so one sequence advances at ``tokens_per_s / concurrency`` tokens/s whether
  the engine is full or not (decoding is memory-bound: a half-empty engine in the tail
  is not faster per sequence). ``batching="continuous"`` lets a group start as soon as
  a slot is free (sglang, vLLM); ``"rounds"`` lets it join only the next round (the
  embedded engine: a round takes every waiting group and ends with its longest one).
  Groups are dispatched in prompt order under the sampler's lookahead bound
  (``can_dispatch``) and ``max_in_flight``, when the driver polls: at a step's start,
  at each arrival while it waits, and after the early refit. With
  ``Workload.deterministic_chunks`` finished groups are filed in dispatch order and a
  chunk is a fixed block once all its groups are done (every ready block at once with
  ``merge_ready_blocks``), as the driver files and takes them.
* **training** (:class:`TrainingCosts`), on one device timeline, in the pump's order
  (DESIGN.md's schedule): per chunk a value forward, a switch, the actor's forward and
  backward, and (when more chunks follow) the switch back, which runs while the pump
  waits; after the chunks one optimizer step, the early refit (the next step's prompts
  may go out then), a switch and ``critic_epochs`` epochs over the whole batch. Every
  call the pump makes to a model also costs ``call_overhead_s`` of the driver's time
  before its work starts (:meth:`TrainingCosts.calls_per_step` counts them), so a mode
  that makes more calls (full batch with K epochs and ``TrainingCosts.logprob_pass``: a
  log-prob pass before epoch 1's ``train_chunk``) pays for each.

All times are seconds. The model is a projection: it knows nothing of memory limits,
stragglers, network contention or engine preemption; a fitted model's error on this
machine is in the README ("Planning with the simulator").
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_sampler._chunk import single_chunk_only
from ppo_sampler._config import SamplerConfig, make_sampler
from ppo_sampler._samplers import Sampler

__all__ = [
    "GenerationModel",
    "LognormalLengths",
    "MeasuredLengths",
    "MinimumRow",
    "SimStep",
    "SimulationResult",
    "SimulationTable",
    "TrainingCosts",
    "Workload",
    "default_minimums",
    "simulate",
    "simulate_minimums",
]

BATCHING = ("continuous", "rounds")
BLOCK_ORDERS = ("dispatch", "length")
SCALING = ("sample", "padded", "packed")


def _number(owner: str, name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a finite float ``>= 0`` (``> 0`` when ``positive``), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number")
    if value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{owner}: {name}={value!r} must be {bound}; a cost, a speed or a length "
            "cannot be negative"
        )
    return float(value)


def _count(owner: str, name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} must be an int >= {minimum}")
    return value


# ---------------------------------------------------------------------- lengths
@dataclass(frozen=True, kw_only=True)
class LognormalLengths:
    """Response lengths in tokens: ``median * exp(sigma * N(0, 1))``, rounded, clipped to
    ``[min_tokens, max_tokens]`` (a long tail whose end is the generation limit)."""

    median: float
    sigma: float
    max_tokens: int
    min_tokens: int = 1

    def __post_init__(self) -> None:
        own = "LognormalLengths"
        _number(own, "median", self.median, positive=True)
        _number(own, "sigma", self.sigma)
        _count(own, "min_tokens", self.min_tokens, minimum=1)
        _count(own, "max_tokens", self.max_tokens, minimum=self.min_tokens)

    def draw(self, rng: random.Random) -> int:
        tokens = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(self.max_tokens, max(self.min_tokens, tokens))


@dataclass(frozen=True, kw_only=True)
class MeasuredLengths:
    """Response lengths from a list (e.g. measured in a run). ``resample=True`` draws
    with replacement; ``False`` takes them in order, cycling (exact schedules).
    ``per_group=True``: each length is a whole group's (its longest sample), drawn once
    per group; else one per sample."""

    lengths: tuple[int, ...]
    resample: bool = True
    per_group: bool = False

    def __post_init__(self) -> None:
        own = "MeasuredLengths"
        if not isinstance(self.lengths, tuple) or not self.lengths:
            raise ValueError(
                f"{own}: lengths={self.lengths!r} must be a non-empty tuple of token counts; "
                "give at least one measured response length"
            )
        for i, n in enumerate(self.lengths):
            _count(own, f"lengths[{i}]", n, minimum=0)
        for name in ("resample", "per_group"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{own}: {name}={getattr(self, name)!r} must be a bool")


Lengths = LognormalLengths | MeasuredLengths


class _LengthSource:
    """Lengths in dispatch order, the same sequence whatever the schedule (so every
    minimum of a sweep sees the same groups: common random numbers)."""

    def __init__(self, model: Lengths, seed: int) -> None:
        self.model = model
        self.rng = random.Random(seed)
        self.index = 0

    def next(self) -> int:
        model = self.model
        if isinstance(model, LognormalLengths):
            return model.draw(self.rng)
        if model.resample:
            return self.rng.choice(model.lengths)
        value = model.lengths[self.index % len(model.lengths)]
        self.index += 1
        return value


# ---------------------------------------------------------------------- models
@dataclass(frozen=True, kw_only=True)
class GenerationModel:
    """The generation side: ``engines`` engines, each decoding up to ``concurrency``
    sequences at ``tokens_per_s`` tokens/s in all.

    ``latency_s`` is added to every group (prefill, reward scoring, the driver's
    collection); with ``batching="rounds"`` a round starts ``latency_s`` after the first
    group of it arrived instead (the embedded engine's gather window).
    """

    tokens_per_s: float
    concurrency: int
    engines: int = 1
    batching: str = "continuous"
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        own = "GenerationModel"
        _number(own, "tokens_per_s", self.tokens_per_s, positive=True)
        _count(own, "concurrency", self.concurrency, minimum=1)
        _count(own, "engines", self.engines, minimum=1)
        _number(own, "latency_s", self.latency_s)
        if self.batching not in BATCHING:
            raise ValueError(
                f"{own}: batching={self.batching!r} is unknown; choose 'continuous' "
                "(a group starts when a slot frees) or 'rounds' (the embedded engine)"
            )

    @property
    def seconds_per_token(self) -> float:
        """Decode time of one token of one sequence."""
        return self.concurrency / self.tokens_per_s


@dataclass(frozen=True, kw_only=True)
class TrainingCosts:
    """Seconds on the training devices. ``*_per_sample`` costs scale with the samples
    of a chunk (value forward, actor forward + backward) or the step (critic training,
    per epoch); the others are paid once per chunk, per step, per switch or per call.

    ``policy_epochs`` > 1 (the project's extension): streaming runs epoch 1 in the
    chunks and epochs 2..K over the whole batch after them, each with its optimizer
    step; full batch does the same with one chunk (the driver's pump since ppo-driver
    0.8.1: epoch 1 is one optimizer step over the batch, so its forward gives the old
    log-probs), or, with ``logprob_pass``, first runs a separate log-prob forward
    (``actor_forward_per_sample``). In both modes the first epoch is the actor's first
    pass over the step's samples (``actor_train_per_sample``) and epochs 2..K repeat it
    (``actor_epoch_per_sample``)."""

    value_forward_per_sample: float = 0.0
    actor_train_per_sample: float = 0.0
    """The actor's first forward + backward over a sample in a step (epoch 1)."""
    critic_train_per_sample: float = 0.0
    actor_forward_per_sample: float = 0.0
    """The separate log-prob forward of a full batch with ``logprob_pass``, per sample."""
    logprob_pass: bool = False
    """A full batch with ``policy_epochs`` > 1 computes the old log-probs in a separate
    forward before epoch 1 (verl's and OpenRLHF's full batch, and ppo-driver's before
    0.8.1); False (default): epoch 1's own forward gives them, as streaming's does."""
    actor_epoch_per_sample: float | None = None
    """Epochs 2..K, per sample and epoch: a repeat pass over samples the actor already
    holds (streaming: the kept chunks; full batch: the batch it has just trained on);
    None: as ``actor_train_per_sample``."""
    critic_epochs: int = 1
    policy_epochs: int = 1
    optimizer_s: float = 0.0
    refit_s: float = 0.0
    switch_s: float = 0.0
    chunk_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    call_overhead_s: float = 0.0
    """The driver's side of every call to a model (its round trip: preparing and
    shipping the call's rows, waiting for the result, the driver's work between calls),
    paid before the call's work on the training timeline; :meth:`calls_per_step` counts
    the calls."""
    scaling: str = "sample"
    """How a pass's work follows its samples' lengths (every ``*_per_sample`` cost):

    * ``"sample"`` (default): every sample costs the same (the costs are means);
    * ``"padded"``: a pass pads its rows to its longest (``prompt_tokens`` + the
      longest response of the chunk), as the project's trainer does: a chunk's work is
      its samples x its width / ``reference_tokens``; the repeat epochs run over the
      chunks at their own widths; a full batch's passes and critic training run at the
      step's width (its widest row);
    * ``"packed"``: padding-free passes (sequence packing, as Megatron's THD layout or
      verl's remove-padding): a pass's work is its samples' tokens (``prompt_tokens`` +
      each response) / ``reference_tokens``. Lengths given per group
      (``MeasuredLengths(per_group=True)``) count every sample of a group at its
      longest.

    With ``"padded"`` or ``"packed"`` the ``*_per_sample`` costs are those of a sample
    of ``reference_tokens`` tokens."""
    reference_tokens: float | None = None
    """The tokens (prompt + response, as padded) a ``*_per_sample`` cost is for; needed
    by ``scaling`` ``"padded"`` and ``"packed"``."""
    prompt_tokens: float = 0.0
    """The prompt's tokens in every row (added to each response's length)."""

    def __post_init__(self) -> None:
        own = "TrainingCosts"
        for name in (
            "value_forward_per_sample",
            "actor_train_per_sample",
            "critic_train_per_sample",
            "actor_forward_per_sample",
            "optimizer_s",
            "refit_s",
            "switch_s",
            "chunk_overhead_s",
            "step_overhead_s",
            "call_overhead_s",
        ):
            _number(own, name, getattr(self, name))
        if self.actor_epoch_per_sample is not None:
            _number(own, "actor_epoch_per_sample", self.actor_epoch_per_sample)
        _count(own, "critic_epochs", self.critic_epochs, minimum=1)
        _count(own, "policy_epochs", self.policy_epochs, minimum=1)
        if self.scaling not in SCALING:
            raise ValueError(
                f"{own}: scaling={self.scaling!r} is unknown; choose 'sample' (every sample "
                "costs the same), 'padded' (a pass pads to its longest row) or 'packed' "
                "(padding-free passes)"
            )
        _number(own, "prompt_tokens", self.prompt_tokens)
        if self.scaling != "sample":
            if self.reference_tokens is None:
                raise ValueError(
                    f"{own}: scaling={self.scaling!r} needs reference_tokens (the tokens of "
                    "the sample the *_per_sample costs are for); give it, or use "
                    "scaling='sample'"
                )
            _number(own, "reference_tokens", self.reference_tokens, positive=True)
        elif self.reference_tokens is not None:
            _number(own, "reference_tokens", self.reference_tokens, positive=True)

    def work(self, responses: Sequence[Sequence[int]]) -> float:
        """A pass's work in samples of ``reference_tokens`` (``scaling="sample"``: its
        samples). ``responses``: per group of the pass, its samples' response lengths."""
        samples = sum(len(g) for g in responses)
        if self.scaling == "sample" or samples == 0:
            return float(samples)
        ref = float(self.reference_tokens or 1.0)
        if self.scaling == "padded":
            width = self.prompt_tokens + max(max(g) for g in responses if g)
            return samples * width / ref
        return sum(self.prompt_tokens * len(g) + sum(g) for g in responses) / ref

    def chunk_s(self, samples: float, *, backward: bool = True) -> float:
        """A chunk's work without the switches (value forward, actor, fixed overhead)."""
        per = self.value_forward_per_sample + (self.actor_train_per_sample if backward else 0.0)
        return self.chunk_overhead_s + per * samples

    def after_chunks_s(self, samples: float, *, logprob_pass: bool) -> float:
        """The policy's work after the chunks: optimizer steps and epochs 2..K (with
        ``logprob_pass``, full batch with K > 1: the log-prob forward and all K epochs,
        the first at ``actor_train_per_sample``)."""
        later = self.actor_epoch_per_sample
        per = self.actor_train_per_sample if later is None else later
        repeats = (self.policy_epochs - 1) * (per * samples + self.optimizer_s)
        if logprob_pass:
            first = self.actor_train_per_sample * samples + self.optimizer_s
            return self.actor_forward_per_sample * samples + first + repeats
        return self.optimizer_s + repeats

    def chunk_calls(self, *, logprob_pass: bool) -> int:
        """Model calls per chunk: the critic's value forward and, unless the full
        batch's log-prob pass comes later, the actor's ``train_chunk``."""
        return 1 if logprob_pass else 2

    def after_chunks_calls(self, *, logprob_pass: bool) -> int:
        """Model calls after the chunks, the refit and critic training included:
        ``finish_step`` and, for K > 1, ``train_epochs``; with ``logprob_pass`` (a full
        batch with K > 1) first the log-prob forward and epoch 1's ``train_chunk``, which
        then come after the chunks."""
        policy = 1 + (1 if self.policy_epochs > 1 else 0)
        if logprob_pass:
            policy += 2
        return policy + 2  # the refit, critic training

    def calls_per_step(self, chunks: float, *, logprob_pass: bool) -> float:
        """The model calls of a step of ``chunks`` chunks (each pays ``call_overhead_s``)."""
        return chunks * self.chunk_calls(logprob_pass=logprob_pass) + self.after_chunks_calls(
            logprob_pass=logprob_pass
        )


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One step's shape and the sampler's settings (the document's keys)."""

    batch: int
    """``ppo.num_prompts_per_step``."""
    min_groups: int
    """``async_rl.min_groups_for_streaming_train`` (== ``batch``: full batch)."""
    samples_per_group: int = 1
    """``ppo.num_generations_per_prompt``."""
    alignment: int = 1
    """The group alignment (:func:`ppo_sampler.group_alignment`)."""
    sampler: str = "in_order"
    """``async_rl.sampler.name``."""
    lookahead: int = 1
    """``async_rl.sampler.max_lookahead_versions`` (``in_order``) and
    ``max_staleness_versions`` (``ready_first``): both bounds get this value."""
    max_in_flight: int = 0
    """``async_rl.max_prompts_in_flight``; 0: ``batch * (1 + lookahead)``."""
    groups_per_call: int = 1
    """Groups sent to an engine in one call (the driver's ``rollout.groups_per_call``):
    a call's groups come back together, when its slowest one is done."""
    deterministic_chunks: bool = False
    """``async_rl.deterministic_chunks`` (as the driver resolved it): every step is cut
    into the fixed blocks of :func:`ppo_sampler.fixed_chunk_sizes`, and a block is
    released once all its groups are done (groups are filed in dispatch order, as the
    driver's rollout manager files them). Needs ``in_order`` without lookahead."""
    merge_ready_blocks: bool = False
    """``async_rl.merge_ready_blocks`` with ``deterministic_chunks``: every block that is
    ready goes into one chunk (one call per model); without it each block is a chunk."""
    block_order: str = "dispatch"
    """The driver's ``async_rl.block_order`` with ``deterministic_chunks``: the order the
    fixed blocks cut a step's groups in. ``dispatch``: groups are filed in dispatch
    order; ``length``: in the order of their longest response, which for groups that
    decode together is the order they finish in, so they are filed as they finish."""

    def __post_init__(self) -> None:
        own = "Workload"
        self.sampler_config()  # the sampler's own checks: batch, minimum, name, lookahead
        _count(own, "samples_per_group", self.samples_per_group, minimum=1)
        _count(own, "alignment", self.alignment, minimum=1)
        _count(own, "max_in_flight", self.max_in_flight, minimum=0)
        _count(own, "groups_per_call", self.groups_per_call, minimum=1)
        if self.block_order not in BLOCK_ORDERS:
            raise ValueError(
                f"Workload: block_order={self.block_order!r} is unknown; use one of "
                f"{', '.join(BLOCK_ORDERS)} (async_rl.block_order)"
            )
        if not isinstance(self.merge_ready_blocks, bool):
            raise ValueError(
                f"Workload: merge_ready_blocks={self.merge_ready_blocks!r} must be a bool "
                "(async_rl.merge_ready_blocks)"
            )
        single_chunk_only(batch=self.batch, min_groups=self.min_groups, alignment=self.alignment)

    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(
            num_prompts_per_step=self.batch,
            min_groups_for_streaming_train=self.min_groups,
            name=self.sampler,
            max_lookahead_versions=self.lookahead,
            max_staleness_versions=self.lookahead,
            deterministic_chunks=self.deterministic_chunks,
        )

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.batch * (1 + self.lookahead)

    def with_min_groups(self, min_groups: int) -> Workload:
        return dataclasses.replace(self, min_groups=min_groups)

    @property
    def chunking(self) -> str:
        """How chunks are cut, in words (the table's heading)."""
        if not self.deterministic_chunks:
            return "as groups arrive"
        ready = ", every ready one in one chunk" if self.merge_ready_blocks else ""
        return f"fixed blocks in {self.block_order} order{ready}"

    @property
    def merges_blocks(self) -> bool:
        """Whether the blocks that are ready at a poll go into one chunk."""
        return self.deterministic_chunks and self.merge_ready_blocks


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class SimStep:
    """One simulated step. ``start_s``/``end_s``: the training timeline (the previous
    step's end to the end of critic training); ``generation_s``: the step's first
    dispatch to its last group's finish; ``busy_s``: training-device work in the step."""

    step: int
    start_s: float
    end_s: float
    chunk_groups: tuple[int, ...]
    busy_s: float
    generation_s: float
    chunk_work: tuple[float, ...] = ()
    """Each chunk's work in samples of the costs' reference (``TrainingCosts.work``);
    empty: its samples."""

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class SimulationResult:
    """Steps of one setting; means are over the steps after ``warmup_steps``."""

    workload: Workload
    steps: tuple[SimStep, ...]
    warmup_steps: int

    @property
    def measured(self) -> tuple[SimStep, ...]:
        return self.steps[self.warmup_steps :] or self.steps

    @property
    def step_s(self) -> float:
        return statistics.fmean(s.step_s for s in self.measured)

    @property
    def chunks_per_step(self) -> float:
        return statistics.fmean(len(s.chunk_groups) for s in self.measured)

    @property
    def idle_frac(self) -> float:
        """Fraction of the measured steps' time the training devices did nothing."""
        total = sum(s.step_s for s in self.measured)
        if total <= 0:
            return 0.0
        # never below 0: a step of busy time only is 1 - busy/total = -1e-16 in floats,
        # printed as "-0.0%"
        return max(0.0, 1.0 - sum(s.busy_s for s in self.measured) / total)

    @property
    def non_final_samples(self) -> float:
        """Mean samples per step trained in chunks before the last one (in samples of
        the costs' reference tokens when the costs scale with lengths)."""
        spg = self.workload.samples_per_group
        return statistics.fmean(
            sum(s.chunk_work[:-1]) if s.chunk_work else spg * sum(s.chunk_groups[:-1])
            for s in self.measured
        )


@dataclass(frozen=True)
class MinimumRow:
    """One minimum of a sweep against the full batch (same lengths, same costs).

    ``overlap_efficiency``: hidden / hideable work, hidden = full-batch step time minus
    streaming step time, hideable = the chunk work (value forward, actor forward and
    backward) of the samples streaming trains before its last chunk; ``None`` when
    nothing is hideable (one chunk per step)."""

    min_groups: int
    step_s: float
    full_batch_step_s: float
    chunks_per_step: float
    chunk_groups: tuple[int, ...]
    idle_frac: float
    overlap_efficiency: float | None
    single_chunk_only: bool

    @property
    def speedup(self) -> float:
        return self.full_batch_step_s / self.step_s if self.step_s > 0 else 1.0


@dataclass(frozen=True)
class SimulationTable:
    rows: tuple[MinimumRow, ...]
    full_batch: SimulationResult
    recommended_min_groups: int
    """The swept minimum with the shortest step; ties go to the larger minimum (fewer
    switches, closer to full-batch learning)."""

    def as_dict(self) -> dict[str, Any]:
        """The table as JSON-ready data (a notebook's or a script's view)."""
        return {
            "workload": dataclasses.asdict(self.full_batch.workload),
            "full_batch_step_s": self.full_batch.step_s,
            "full_batch_idle_frac": self.full_batch.idle_frac,
            "recommended_min_groups": self.recommended_min_groups,
            "rows": [
                {
                    **dataclasses.asdict(r),
                    "speedup": r.speedup,
                    "chunk_groups": list(r.chunk_groups),
                }
                for r in self.rows
            ],
        }

    def format(self) -> str:
        wl = self.full_batch.workload
        lines = [
            f"SIMULATION (a projection, not a measurement): batch={wl.batch} groups x "
            f"{wl.samples_per_group} samples, sampler={wl.sampler}, lookahead={wl.lookahead}, "
            f"chunks: {wl.chunking}",
            f"full batch: {self.full_batch.step_s:.3f} s/step, "
            f"idle {self.full_batch.idle_frac:.1%}",
            f"{'min':>5} {'step_s':>9} {'full_s':>9} {'speedup':>7} {'chunks':>6} "
            f"{'idle':>6} {'overlap':>7}  chunk sizes (first measured step)",
        ]
        for r in self.rows:
            eff = "-" if r.overlap_efficiency is None else f"{r.overlap_efficiency:.2f}"
            mark = " <- recommended" if r.min_groups == self.recommended_min_groups else ""
            sizes = "+".join(map(str, r.chunk_groups))
            one = " (single chunk only)" if r.single_chunk_only and r.min_groups < wl.batch else ""
            lines.append(
                f"{r.min_groups:>5} {r.step_s:>9.3f} {r.full_batch_step_s:>9.3f} "
                f"{r.speedup:>6.2f}x {r.chunks_per_step:>6.2f} {r.idle_frac:>6.1%} "
                f"{eff:>7}  {sizes}{one}{mark}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------- the engines
@dataclass
class _Engine:
    """Continuous: the times its slots free up. Rounds: ``[start, end, groups]`` rows."""

    slots: list[float] = field(default_factory=list)
    rounds: list[list[float]] = field(default_factory=list)
    load: int = 0


class _Generation:
    def __init__(self, model: GenerationModel, spg: int) -> None:
        self.model = model
        self.spg = spg
        self.slots = max(1, model.concurrency // spg)  # groups per engine
        self.engines = [_Engine() for _ in range(model.engines)]

    def least_loaded(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (self.engines[i].load, i))

    def finish_time(self, now: float, group_len: int, on: int | None = None) -> tuple[int, float]:
        """Dispatch a group of ``group_len`` tokens (its longest sample) at ``now`` to
        engine ``on`` (``None``: the least loaded one); returns (engine, finish time)."""
        index = self.least_loaded() if on is None else on
        engine = self.engines[index]
        engine.load += 1
        decode = group_len * self.model.seconds_per_token
        if self.model.batching == "continuous":
            full = len(engine.slots) >= self.slots  # then it waits for the first free slot
            start = max(now, heapq.heappop(engine.slots)) if full else now
            end = start + self.model.latency_s + decode
            heapq.heappush(engine.slots, end)
            return index, end
        rounds = engine.rounds
        last = rounds[-1] if rounds else None
        if last is not None and now <= last[0] and last[2] < self.slots:
            last[1] = max(last[1], last[0] + decode)  # joins the round still gathering
            last[2] += 1
            return index, last[0] + decode
        start = now + self.model.latency_s
        if last is not None:
            start = max(start, last[1])
        rounds.append([start, start + decode, 1])
        return index, start + decode

    def done(self, engine: int) -> None:
        self.engines[engine].load -= 1


# ---------------------------------------------------------------------- the simulation
class _Run:
    """The state of one simulation: the real sampler, the generation side, the clock."""

    def __init__(
        self,
        workload: Workload,
        generation: GenerationModel,
        costs: TrainingCosts,
        lengths: Lengths,
        seed: int,
    ) -> None:
        self.wl = workload
        self.costs = costs
        self.sampler: Sampler = make_sampler(workload.sampler_config())
        self.gen = _Generation(generation, workload.samples_per_group)
        self.lengths = _LengthSource(lengths, seed)
        self.arrivals: list[tuple[float, int, int, int, int]] = []  # (t, gid, step, ver, eng)
        self.next_gid = 0
        self.in_flight = 0
        self.weight_version = 0
        self.admit = 0  # the trainer step the dispatch bound is measured from
        self.first_dispatch: dict[int, float] = {}
        self.last_finish: dict[int, float] = {}
        self.responses: dict[int, list[int]] = {}  # gid -> its samples' response lengths
        # deterministic chunks: finished groups wait here until every group dispatched
        # before them is filed (gid -> (step, version)); the next gid to file
        self.held: dict[int, tuple[int, int]] = {}
        self.next_to_file = 0
        # every group dispatched and not filed: gid -> (when it began decoding, its longest
        # response, when its call returns, its step); block_order "length" files by it
        self.out: dict[int, tuple[float, int, float, int]] = {}

    def dispatch(self, now: float) -> None:
        """What the rollout manager sends at a poll: prompts in order, lookahead-bound,
        in calls of up to ``groups_per_call`` groups to the least loaded engine; a
        call's groups arrive together, when its slowest one is done."""
        while self.in_flight < self.wl.in_flight_limit:
            room = self.wl.in_flight_limit - self.in_flight
            engine = self.gen.least_loaded()
            call: list[tuple[int, int]] = []  # (gid, step)
            end = now
            starts: list[tuple[float, int]] = []  # (its decoding's start, its longest)
            while len(call) < min(room, self.wl.groups_per_call):
                step = self.next_gid // self.wl.batch
                if not self.sampler.can_dispatch(step, trainer_step=self.admit):
                    break
                longest = self._group_len(self.next_gid)
                _, finish = self.gen.finish_time(now, longest, engine)
                starts.append((finish - longest * self.gen.model.seconds_per_token, longest))
                end = max(end, finish)
                self.first_dispatch.setdefault(step, now)
                call.append((self.next_gid, step))
                self.next_gid += 1
            for (gid, step), (begun, longest) in zip(call, starts, strict=True):
                heapq.heappush(self.arrivals, (end, gid, step, self.weight_version, engine))
                self.out[gid] = (begun, longest, end, step)
            self.in_flight += len(call)
            if len(call) < self.wl.groups_per_call:
                return  # the sampler admits no more (or no room): the rest waits

    def _group_len(self, gid: int) -> int:
        """Draw group ``gid``'s response lengths; returns its longest."""
        model = self.lengths.model
        spg = self.wl.samples_per_group
        if isinstance(model, MeasuredLengths) and model.per_group:
            responses = [self.lengths.next()] * spg  # each sample at the group's longest
        else:
            responses = [self.lengths.next() for _ in range(spg)]
        self.responses[gid] = responses
        return max(responses)

    def arrive_until(self, now: float) -> None:
        """File every group finished by ``now`` (the sampler's ``add``), then dispatch."""
        while self.arrivals and self.arrivals[0][0] <= now:
            end, gid, step, version, engine = heapq.heappop(self.arrivals)
            self.gen.done(engine)
            self.in_flight -= 1
            self.last_finish[step] = max(self.last_finish.get(step, end), end)
            if not self.wl.deterministic_chunks:
                self.out.pop(gid)
                self.sampler.add(gid, step=step, weight_version=version)
                continue
            self.held[gid] = (step, version)
            if self.wl.block_order == "dispatch":  # in dispatch order (gids ascend)
                while self.next_to_file in self.held:
                    step, version = self.held.pop(self.next_to_file)
                    self.out.pop(self.next_to_file)
                    self.sampler.add(self.next_to_file, step=step, weight_version=version)
                    self.next_to_file += 1
        if self.wl.deterministic_chunks and self.wl.block_order == "length":
            self._file_by_length(now)
        self.dispatch(now)

    def _release(self, gid: int, tokens: int) -> float:
        """When group ``gid`` no longer holds back a group whose longest response has
        ``tokens``: once it has drawn that many (the engines' progress reports), or, if
        it is not longer, once its call is back."""
        begun, longest, back, _ = self.out[gid]
        if longest > tokens:
            return begun + tokens * self.gen.model.seconds_per_token
        return back

    def _filing_time(self, gid: int) -> float:
        """block_order "length": when held group ``gid`` can be filed (infinite while a
        group of its step is not dispatched yet)."""
        _, tokens, _, step = self.out[gid]
        if self.next_gid < (step + 1) * self.wl.batch:
            return math.inf
        others = [h for h, o in self.out.items() if o[3] == step and h not in self.held]
        return max((self._release(h, tokens) for h in others), default=-math.inf)

    def _file_by_length(self, now: float) -> None:
        """File the held groups no group out can come before, by longest response (group
        id among equals), as the driver's rollout manager does."""
        # a shorter group can be filed no later than a longer one: stop at the first held
        for gid in sorted(self.held, key=lambda g: (self.out[g][1], g)):
            if self._filing_time(gid) > now:
                break
            step, version = self.held.pop(gid)
            self.out.pop(gid)
            self.sampler.add(gid, step=step, weight_version=version)

    def _next_event(self) -> float:
        """The next arrival, or the next time a held group can be filed."""
        filing = math.inf
        if self.held and self.wl.deterministic_chunks and self.wl.block_order == "length":
            filing = self._filing_time(min(self.held, key=lambda g: (self.out[g][1], g)))
        return min(self.arrivals[0][0] if self.arrivals else math.inf, filing)

    def wait_for_chunk(self, poll_s: float, step: int, remaining: int) -> tuple[float, list[int]]:
        """Poll at ``poll_s`` and then at each arrival until the sampler releases a chunk
        (with :attr:`Workload.merges_blocks`, every block that is ready: the pump's
        ``ChunkGate.take``)."""
        now = poll_s
        while True:
            self.arrive_until(now)
            ids: list[int] = []
            while len(ids) < remaining:
                block = self.sampler.select(
                    trainer_step=step,
                    trainer_version=self.weight_version,
                    remaining=remaining - len(ids),
                    min_groups=self.wl.min_groups,
                    alignment=self.wl.alignment,
                )
                ids += [int(g) for g in block]
                if not (block and self.wl.merges_blocks):
                    break
            if ids:
                return now, ids
            now = self._next_event()
            assert math.isfinite(now), "the sampler waits while nothing is generating (a bug)"

    def step(self, step: int, start: float) -> SimStep:
        c, wl = self.costs, self.wl
        self.admit = step
        self.arrive_until(start)
        poll = device = start
        busy = 0.0
        chunks: list[int] = []
        chunk_work: list[float] = []
        claimed: list[int] = []
        remaining = wl.batch
        logprob_pass = c.logprob_pass and wl.min_groups == wl.batch and c.policy_epochs > 1
        while remaining:
            released, ids = self.wait_for_chunk(poll, step, remaining)
            claimed += ids
            remaining -= len(ids)
            chunks.append(len(ids))
            samples = c.work([self.responses[g] for g in ids])
            chunk_work.append(samples)
            calls = c.chunk_calls(logprob_pass=logprob_pass) * c.call_overhead_s
            work = c.chunk_s(samples, backward=not logprob_pass) + c.switch_s + calls
            device = max(released, device) + work
            busy += work
            poll = device  # the pump polls again once the actor's call returned
            if remaining:  # the critic wakes while the pump waits (queued switch)
                device += c.switch_s
                busy += c.switch_s
        # the policy's update(s), the early refit, then the next step may be generated;
        # epochs 2..K repeat the chunks the actor holds (full batch: its one chunk)
        kept = sum(chunk_work)
        calls = c.after_chunks_calls(logprob_pass=logprob_pass) * c.call_overhead_s
        update = c.after_chunks_s(kept, logprob_pass=logprob_pass) + c.refit_s
        update += calls - c.call_overhead_s  # all but critic training's call
        device += update
        self.weight_version += 1
        self.admit = step + 1
        self.arrive_until(device)
        batch_work = c.work([self.responses[g] for g in claimed])  # the step batch
        tail = c.switch_s + c.critic_train_per_sample * batch_work * c.critic_epochs
        tail += c.step_overhead_s + c.call_overhead_s
        device += tail
        busy += update + tail
        self.sampler.mark_consumed(claimed)
        for g in claimed:
            del self.responses[g]
        generation = self.last_finish[step] - self.first_dispatch[step]
        return SimStep(step, start, device, tuple(chunks), busy, generation, tuple(chunk_work))


def simulate(
    workload: Workload,
    generation: GenerationModel,
    costs: TrainingCosts,
    lengths: Lengths,
    *,
    steps: int = 8,
    warmup_steps: int = 1,
    seed: int = 0,
) -> SimulationResult:
    """Simulate ``steps`` consecutive steps of ``workload``; see the module docstring.

    Raises:
        ValueError: naming the argument, for ``steps < 1`` or ``warmup_steps`` not in
            ``[0, steps)`` (the models check their own fields when built).
    """
    _count("simulate", "steps", steps, minimum=1)
    _count("simulate", "warmup_steps", warmup_steps, minimum=0)
    if warmup_steps >= steps:
        raise ValueError(
            f"simulate: warmup_steps={warmup_steps} leaves none of steps={steps} measured; "
            "set warmup_steps below steps"
        )
    _count("simulate", "seed", seed, minimum=0)
    run = _Run(workload, generation, costs, lengths, seed)
    out: list[SimStep] = []
    clock = 0.0
    for step in range(steps):
        out.append(run.step(step, clock))
        clock = out[-1].end_s
    return SimulationResult(workload, tuple(out), warmup_steps)


def default_minimums(batch: int, alignment: int = 1) -> list[int]:
    """A sweep: fractions of the batch (1/16 .. 3/4), the last minimum that can still
    split (about two thirds), and the batch itself; aligned, distinct, ascending."""
    picks = {max(1, round(batch * f)) for f in (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)}
    splits = [m for m in range(1, batch) if not single_chunk_only(batch=batch, min_groups=m)]
    if splits:
        picks.add(splits[-1])
    picks.add(batch)
    aligned = {max(alignment, m - m % alignment) for m in picks}
    return sorted(m for m in aligned if m <= batch)


def simulate_minimums(
    workload: Workload,
    generation: GenerationModel,
    costs: TrainingCosts,
    lengths: Lengths,
    *,
    minimums: Sequence[int] | None = None,
    steps: int = 8,
    warmup_steps: int = 1,
    seed: int = 0,
) -> SimulationTable:
    """Simulate each minimum (default :func:`default_minimums`) and the full batch with
    the same lengths and costs; returns the table (``.format()`` prints it).

    Raises:
        ValueError: for an empty ``minimums`` or one the sampler refuses (e.g. above
            the batch), naming it.
    """
    chosen = list(
        default_minimums(workload.batch, workload.alignment) if minimums is None else minimums
    )
    if not chosen:
        raise ValueError("simulate_minimums: minimums=[] is empty; give at least one minimum")
    kw = {"steps": steps, "warmup_steps": warmup_steps, "seed": seed}
    full = simulate(workload.with_min_groups(workload.batch), generation, costs, lengths, **kw)
    rows: list[MinimumRow] = []
    for low in chosen:
        wl = workload.with_min_groups(low)
        result = full if low == workload.batch else simulate(wl, generation, costs, lengths, **kw)
        hideable = (
            costs.value_forward_per_sample + costs.actor_train_per_sample
        ) * result.non_final_samples
        hidden = full.step_s - result.step_s
        rows.append(
            MinimumRow(
                min_groups=low,
                step_s=result.step_s,
                full_batch_step_s=full.step_s,
                chunks_per_step=result.chunks_per_step,
                chunk_groups=result.measured[0].chunk_groups,
                idle_frac=result.idle_frac,
                overlap_efficiency=hidden / hideable if hideable > 0 else None,
                single_chunk_only=single_chunk_only(
                    batch=wl.batch, min_groups=low, alignment=wl.alignment
                ),
            )
        )
    best = min(rows, key=lambda r: (round(r.step_s, 9), -r.min_groups))
    return SimulationTable(tuple(rows), full, best.min_groups)
