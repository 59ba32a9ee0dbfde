"""``ppo-driver simulate --from runs/<name>``: fit the step simulator on a real run and
answer "what if" (another minimum, batch, engine count, lookahead, or streaming off).

What is fitted, from the run's ``config.yaml`` (its shape) and ``metrics.jsonl`` (per
step: the phases' seconds, as the trace timed them, and each group's longest response):

* lengths: the groups' longest responses, resampled (:class:`ppo_sampler.MeasuredLengths`
  with ``per_group=True``), so a group finishes when its longest sample does;
* generation: seconds per decoded token of one sequence, from each step's generation
  window (first dispatch to last arrival) over its longest group, minus the engine's
  gather window; every group in flight decodes at once (the embedded engine batches a
  round; sglang batches continuously);
* widths: each chunk's padded row (``train/chunk_widths``): the costs scale with them
  (``TrainingCosts(scaling="padded")``: a chunk pads its rows to its longest, a full
  batch and critic training to the step's), per sample of the run's mean chunk width;
  the prompt's tokens are the step's widest row minus its longest response. A run
  recorded before the widths were (ppo-driver 0.8.1) is fitted per sample;
* training costs per sample (value forward, the actor's first forward + backward over
  the step's samples and its repeat passes, epochs 2..K, critic training per epoch),
  per optimizer step, per refit, per model switch, and per model call: what remains of
  the step when the wait and every phase timed inside the workers are taken out (the
  driver's round trips, shipping rows, GAE, batch assembly), divided by the model calls
  the run made (counted in its trace), so this follows the mode instead of being
  carried over as a constant.

A full batch makes streaming's calls with one chunk (epoch 1's ``train_chunk``, whose
forward gives the old log-probs, ``finish_step``, ``train_epochs``) and is fitted as
streaming is. One recorded before ppo-driver 0.8.1 ran a separate log-prob forward and
K ``train_chunk`` + ``finish_step`` pairs a step (2K + 1 policy calls): it is fitted from
those pairs, and its log-prob pass is fitted (``actor_forward_per_sample``) but not
projected (``TrainingCosts.logprob_pass`` stays off: the projection is of today's pump).

The simulator (:func:`ppo_sampler.simulate_minimums`) then replays steps through the
real sampler with these costs. It projects; it does not measure. Groups travel as the
run sent them, ``rollout.groups_per_call`` to a call (``Workload.groups_per_call``: a
call's groups come back together, with its slowest one).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, TypedDict

import yaml
from ppo_sampler import (
    GenerationModel,
    MeasuredLengths,
    SimulationTable,
    TrainingCosts,
    Workload,
    simulate_minimums,
)

from ppo_driver._json import JSONValue, as_float, as_int
from ppo_driver.config.schema import block_order, groups_per_call
from ppo_driver.config.schema import deterministic_chunks as resolve_deterministic_chunks
from ppo_driver.trace import TraceEvent

__all__ = ["FittedRun", "fit_run", "what_if"]

_Seconds = Literal[
    "perf/step_s",
    "perf/generation_s",
    "perf/wait_s",
    "perf/chunk_s",
    "perf/value_s",
    "perf/backward_s",
    "perf/logprob_s",
    "perf/update_s",
    "perf/refit_s",
    "perf/critic_s",
    "perf/switch_s",
]
_Counts = Literal["train/chunks", "train/switches"]

_StepRow = TypedDict(
    "_StepRow",
    {
        "step": int,
        "rollout/group_len_max": list[int],
        "perf/step_s": float,
        "perf/generation_s": float,
        "perf/wait_s": float,
        "perf/chunk_s": float,
        "perf/value_s": float,
        "perf/backward_s": float,
        "perf/logprob_s": float,
        "perf/update_s": float,
        "perf/refit_s": float,
        "perf/critic_s": float,
        "perf/switch_s": float,
        "train/chunks": float,
        "train/switches": float,
        "train/chunk_groups": list[int],
        "train/chunk_widths": list[int],
    },
    total=False,
)
"""The part of a ``metrics.jsonl`` row the simulator reads (the pump writes more)."""

EMBEDDED_GATHER_S = 0.05
"""The embedded engine's gather window (``EmbeddedEngine(gather_s=...)``'s default): a
round starts this long after its last group joined."""


@dataclass(frozen=True)
class FittedRun:
    """A run's shape and costs as the simulator takes them."""

    workload: Workload
    generation: GenerationModel
    costs: TrainingCosts
    lengths: MeasuredLengths
    measured_step_s: float
    """Mean ``perf/step_s`` of the steps fitted on."""
    steps_used: int
    deterministic_given: bool | None = False
    """The run's ``async_rl.deterministic_chunks`` as written (null resolves by the
    generation's placement and the sampler, again under another lookahead)."""
    generation_placement: tuple[str, float] = ("embedded", 0.0)
    """The run's ``rollout.engine`` and ``rollout.decode_delay_s`` (what null resolves by)."""
    block_order_given: str | None = "dispatch"
    """The run's ``async_rl.block_order`` as written."""


def _section(config: Mapping[str, JSONValue], key: str) -> Mapping[str, JSONValue]:
    value = config.get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"config.yaml: {key} must be a mapping, got {type(value).__name__}")
    return value


def _mean(rows: Sequence[_StepRow], key: _Seconds | _Counts) -> float:
    return statistics.fmean(as_float(r.get(key) or 0.0) for r in rows)


def fit_run(run_dir: str | Path, *, skip_steps: int = 1, widths: bool = True) -> FittedRun:
    """Fit the simulator's models on ``run_dir`` (``config.yaml`` + ``metrics.jsonl``),
    leaving out the first ``skip_steps`` steps (start-up warms caches) when later ones
    exist. ``widths=False``: costs per sample even when the run recorded its chunks'
    widths.

    Raises:
        ValueError: naming the file and what is missing (no run there, no steps
            recorded, a run written before ``rollout/group_len_max`` was recorded).
    """
    if isinstance(skip_steps, bool) or not isinstance(skip_steps, int) or skip_steps < 0:
        raise ValueError(f"--skip-steps={skip_steps!r} must be an int >= 0 (steps not fitted on)")
    run = Path(run_dir)
    config_path, metrics_path = run / "config.yaml", run / "metrics.jsonl"
    for path in (config_path, metrics_path):
        if not path.is_file():
            raise ValueError(
                f"--from {run}: {path.name} is missing; point --from at a run directory "
                "that ppo-driver train wrote (it holds config.yaml and metrics.jsonl)"
            )
    config = yaml.safe_load(config_path.read_text()) or {}
    rows = _read_rows(metrics_path)
    if not rows:
        raise ValueError(f"--from {run}: metrics.jsonl records no step; let the run finish one")
    missing = [r.get("step") for r in rows if not r.get("rollout/group_len_max")]
    if missing:
        raise ValueError(
            f"--from {run}: metrics.jsonl has no rollout/group_len_max for step(s) {missing} "
            "(written by ppo-driver before the simulator); rerun the run to record them"
        )
    used = rows[skip_steps:] or rows
    ppo, async_rl = _section(config, "ppo"), _section(config, "async_rl")
    sampler, rollout = _section(async_rl, "sampler"), _section(config, "rollout")
    batch = as_int(ppo.get("num_prompts_per_step", 64))
    spg = as_int(ppo.get("num_generations_per_prompt", 4))
    min_groups = as_int(async_rl.get("min_groups_for_streaming_train", batch))
    name = str(sampler.get("name", "in_order"))
    bound = "max_lookahead_versions" if name == "in_order" else "max_staleness_versions"
    lookahead = as_int(sampler.get(bound, 0))
    # a run recorded before the keys cut its chunks as groups arrived, or fixed blocks
    # in dispatch order
    given = async_rl.get("deterministic_chunks", False)
    order_given = async_rl.get("block_order", "dispatch")
    placement = (
        str(rollout.get("engine", "embedded")),
        as_float(rollout.get("decode_delay_s") or 0.0),
    )
    fixed, order = _chunking(given, order_given, placement, sampler=name, lookahead=lookahead)
    workload = Workload(
        batch=batch,
        min_groups=min_groups,
        samples_per_group=spg,
        sampler=name,
        lookahead=lookahead,
        max_in_flight=as_int(async_rl.get("max_prompts_in_flight", 0)),
        groups_per_call=_groups_per_call(rollout),
        deterministic_chunks=fixed,
        merge_ready_blocks=bool(async_rl.get("merge_ready_blocks", True)),
        block_order=order,
    )
    lengths = MeasuredLengths(
        lengths=tuple(int(n) for r in used for n in r["rollout/group_len_max"]), per_group=True
    )
    trace = _read_trace(run / "trace.json")
    generation = _fit_generation(used, workload, rollout, _observed_ends(trace))
    steps = {int(r["step"]) for r in used}
    calls = _update_calls(trace, steps)
    costs = _fit_costs(
        used,
        workload,
        ppo,
        calls,
        _actor_passes(trace, steps),
        _widths(used) if widths else None,
        _model_calls(trace, steps),
    )
    return FittedRun(
        workload=workload,
        generation=generation,
        costs=costs,
        lengths=lengths,
        measured_step_s=_mean(used, "perf/step_s"),
        steps_used=len(used),
        deterministic_given=None if given is None else bool(given),
        generation_placement=placement,
        block_order_given=None if order_given is None else str(order_given),
    )


def _chunking(
    given: JSONValue,
    order_given: JSONValue,
    placement: tuple[str, float],
    *,
    sampler: str,
    lookahead: int,
) -> tuple[bool, str]:
    """``async_rl.deterministic_chunks`` and ``async_rl.block_order`` resolved as
    ``train`` resolves them."""
    engine, delay = placement
    order = block_order(
        None if order_given is None else str(order_given), engine=engine, decode_delay_s=delay
    )
    fixed = resolve_deterministic_chunks(
        None if given is None else bool(given),
        engine=engine,
        decode_delay_s=delay,
        sampler=sampler,
        lookahead=lookahead,
        order=order,
    )
    return fixed, order


def _groups_per_call(rollout: Mapping[str, JSONValue]) -> int:
    """The run's groups per engine call: its ``rollout.groups_per_call`` resolved as
    ``train`` resolved it; 1 for a run recorded before the key (one call per group)."""
    if "groups_per_call" not in rollout:
        return 1
    given = rollout["groups_per_call"]
    return groups_per_call(
        None if given is None else as_int(given),
        engine=str(rollout.get("engine", "embedded")),
        decode_delay_s=as_float(rollout.get("decode_delay_s") or 0.0),
    )


def _read_rows(path: Path) -> list[_StepRow]:
    """The rows of ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_trace(path: Path) -> list[TraceEvent]:
    """The complete events of ``trace.json`` ([] without one)."""
    if not path.is_file():
        return []
    events = json.loads(path.read_text()).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X"]


def _observed_ends(events: Sequence[TraceEvent]) -> set[int]:
    """Steps whose generation window ends when the pump saw the last group arrive.

    The window closes when the pump files the step's last group; that is the moment it
    arrived only if the pump was polling then, i.e. a wait of that step ends there.
    Otherwise (the pump was training, e.g. critic training while the next step
    generated) the window is only an upper bound of the generation time."""
    waits: dict[int, list[float]] = {}
    for e in events:
        if e.get("cat") == "wait":
            waits.setdefault(as_int(e["args"].get("step", -1)), []).append(e["ts"] + e["dur"])
    out: set[int] = set()
    for e in events:
        if e.get("cat") == "generation":
            step, end = as_int(e["args"].get("step", -1)), e["ts"] + e["dur"]
            if any(abs(end - w) < _OBSERVED_US for w in waits.get(step, [])):
                out.add(step)
    return out


_OBSERVED_US = 50_000.0
"""A generation window ending within 50 ms of a wait's end was observed as it ended."""


def _fit_generation(
    rows: Sequence[_StepRow],
    workload: Workload,
    rollout: Mapping[str, JSONValue],
    observed: set[int],
) -> GenerationModel:
    """Seconds per token: the median over steps whose generation end the pump observed;
    with none, the smallest upper bound (then generation hid behind training, where its
    exact speed matters less)."""
    engines = as_int(rollout.get("num_engines", 1))
    embedded = rollout.get("engine", "embedded") == "embedded"
    latency = EMBEDDED_GATHER_S if embedded else 0.0
    timed = [
        (
            int(r["step"]),
            (float(r["perf/generation_s"]) - latency) / max(r["rollout/group_len_max"]),
        )
        for r in rows
        if r.get("perf/generation_s") and max(r["rollout/group_len_max"]) > 0
    ]
    exact = [t for step, t in timed if step in observed]
    if exact:
        seconds_per_token = statistics.median(exact)
    else:
        seconds_per_token = min((t for _, t in timed), default=1e-3)
    seconds_per_token = max(1e-6, seconds_per_token)
    # every group in flight decodes at once: one engine holds its share of them
    groups = -(-workload.in_flight_limit // engines)
    concurrency = groups * workload.samples_per_group
    return GenerationModel(
        tokens_per_s=concurrency / seconds_per_token,
        concurrency=concurrency,
        engines=engines,
        batching="rounds" if embedded else "continuous",
        latency_s=latency,
    )


def _update_calls(events: Sequence[TraceEvent], steps: set[int]) -> dict[str, float]:
    """Mean seconds per step of the actor's update calls in the trace (``finish_step``:
    one optimizer step; ``train_epochs``: epochs 2..K, each with its step)."""
    totals: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "update" and e.get("args", {}).get("step") in steps:
            totals[e["name"]] = totals.get(e["name"], 0.0) + float(e["dur"]) / 1e6
    return {name: seconds / len(steps) for name, seconds in totals.items()}


_CALL_CATEGORIES = frozenset({"value", "logprob", "backward", "update", "refit", "critic"})
"""The trace categories of the pump's model calls (value forward, log-prob forward,
``train_chunk``, ``finish_step`` / ``train_epochs``, the refit, critic training)."""


def _model_calls(events: Sequence[TraceEvent], steps: set[int]) -> float | None:
    """Mean model calls per step in the trace (what the untimed time is shared by):
    the run's own count, whichever pump recorded it; None without a traced call."""
    counted = sum(
        1
        for e in events
        if e.get("cat") in _CALL_CATEGORIES and e.get("args", {}).get("step") in steps
    )
    return counted / len(steps) if counted else None


def _actor_passes(events: Sequence[TraceEvent], steps: set[int]) -> tuple[float, float] | None:
    """A full batch's K ``train_chunk`` calls per step: (mean seconds of each step's
    first, mean seconds of the later ones); None without a step that made two.

    The first pass over a step's samples costs more than the repeats (in the bench's
    traces 1.5-2x: its rows arrive, and memory freed while the actor slept is touched
    again), so epoch 1 and epochs 2..K are fitted apart, as streaming's are (its chunks
    hold epoch 1, ``train_epochs`` the repeats)."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        step = e.get("args", {}).get("step")
        if e.get("name") == "train_chunk" and isinstance(step, int) and step in steps:
            by_step.setdefault(step, []).append((float(e["ts"]), float(e["dur"]) / 1e6))
    firsts: list[float] = []
    repeats: list[float] = []
    for passes in by_step.values():
        if len(passes) > 1:
            passes.sort()
            firsts.append(passes[0][1])
            repeats.extend(d for _, d in passes[1:])
    if not firsts:
        return None
    return statistics.fmean(firsts), statistics.fmean(repeats)


@dataclass(frozen=True)
class _Widths:
    """The fitted run's row widths, in tokens."""

    reference: float
    """The mean padded width of a sample's row in its chunk: the width the per-sample
    costs are for."""
    prompt: float
    step_ratio: float
    """The step batch's width over ``reference``, in the mean (critic training)."""


def _widths(rows: Sequence[_StepRow]) -> _Widths | None:
    """The chunks' widths weighted by their groups (a group's samples share its chunk),
    or None when a row lacks them (a run recorded before they were)."""
    if not all(r.get("train/chunk_widths") and r.get("train/chunk_groups") for r in rows):
        return None
    chunked = weights = stepped = 0.0
    prompts: list[float] = []
    for r in rows:
        widths, groups = r["train/chunk_widths"], r["train/chunk_groups"]
        chunked += sum(w * g for w, g in zip(widths, groups, strict=True))
        weights += sum(groups)
        stepped += max(widths) * sum(groups)
        prompts.append(max(widths) - max(r["rollout/group_len_max"]))
    reference = chunked / weights
    return _Widths(reference, max(0.0, statistics.median(prompts)), stepped / chunked)


def _fit_costs(
    rows: Sequence[_StepRow],
    workload: Workload,
    ppo: Mapping[str, JSONValue],
    calls: Mapping[str, float],
    passes: tuple[float, float] | None = None,
    widths: _Widths | None = None,
    calls_made: float | None = None,
) -> TrainingCosts:
    """``calls_made``: the model calls a step of the run made (counted in its trace);
    None: as the current pump makes them (:meth:`TrainingCosts.calls_per_step`)."""
    samples = workload.batch * workload.samples_per_group
    epochs = as_int(ppo.get("ppo_epochs", 1))
    critic_epochs = as_int(ppo.get("critic_ppo_epochs", 1))
    # a full batch recorded before ppo-driver 0.8.1 ran a separate log-prob forward,
    # then its K epochs as K train_chunk + finish_step pairs (backward_s and update_s
    # hold all K); since, it makes streaming's calls with one chunk (epoch 1's
    # train_chunk, one finish_step, train_epochs for epochs 2..K), and so is fitted
    logprob_pass = _mean(rows, "perf/logprob_s") > 0
    pairs = logprob_pass and epochs > 1 and "train_epochs" not in calls and bool(calls)
    value = _mean(rows, "perf/value_s") / samples
    actor = _mean(rows, "perf/backward_s") / (samples * (epochs if pairs else 1))
    update = _mean(rows, "perf/update_s")
    later: float | None = None
    if pairs:
        optimizer = update / epochs
        if passes is not None:  # epoch 1 (the first pass) and the repeats, apart
            actor, later = passes[0] / samples, passes[1] / samples
    else:  # one optimizer step (finish_step) + epochs 2..K, each with its step
        optimizer = calls.get("finish_step", update if epochs == 1 else 0.0)
        if epochs > 1 and "train_epochs" in calls:
            per_epoch = calls["train_epochs"] / (epochs - 1) - optimizer
            later = max(0.0, per_epoch / samples)
    # a run without the log-prob pass timed none: the critic's forward stands in (the
    # same shape here), for a projection with TrainingCosts.logprob_pass
    forward = _mean(rows, "perf/logprob_s") / samples if logprob_pass else value
    chunks = _mean(rows, "train/chunks")
    switches = _mean(rows, "train/switches") or 2 * chunks
    switch_total = _mean(rows, "perf/switch_s")
    per_switch = switch_total / switches if switches else 0.0
    # every phase timed inside the workers (and the wait); the rest is the driver's
    timed = sum(
        _mean(rows, key)
        for key in (
            "perf/wait_s",
            "perf/value_s",
            "perf/backward_s",
            "perf/logprob_s",
            "perf/update_s",
            "perf/refit_s",
            "perf/critic_s",
            "perf/switch_s",
        )
    )
    untimed = max(0.0, _mean(rows, "perf/step_s") - timed)
    # critic training runs over the step batch, padded to its widest chunk
    critic_width = widths.step_ratio if widths is not None else 1.0
    costs = TrainingCosts(
        value_forward_per_sample=value,
        actor_train_per_sample=actor,
        critic_train_per_sample=_mean(rows, "perf/critic_s")
        / (samples * critic_epochs * critic_width),
        actor_forward_per_sample=forward,
        actor_epoch_per_sample=later,
        critic_epochs=critic_epochs,
        policy_epochs=epochs,
        optimizer_s=optimizer,
        refit_s=_mean(rows, "perf/refit_s"),
        switch_s=per_switch,
        scaling="sample" if widths is None else "padded",
        reference_tokens=None if widths is None else widths.reference,
        prompt_tokens=0.0 if widths is None else widths.prompt,
    )
    made = calls_made or costs.calls_per_step(chunks, logprob_pass=pairs)
    return replace(costs, call_overhead_s=untimed / made)


def what_if(
    fit: FittedRun,
    *,
    batch: int | None = None,
    engines: int | None = None,
    lookahead: int | None = None,
    deterministic_chunks: bool | None = None,
) -> tuple[Workload, GenerationModel]:
    """The fitted workload and generation with another batch, engine count, lookahead
    or chunking (``deterministic_chunks``: fixed blocks or chunks by arrival; left out,
    the run's setting, a null one resolved again under the new lookahead). The in-flight
    limit follows them as the driver's default does when the run used it. Raises
    ValueError (the simulator's) for values it refuses."""
    wl = fit.workload
    new_batch = wl.batch if batch is None else batch
    new_lookahead = wl.lookahead if lookahead is None else lookahead
    given = fit.deterministic_given if deterministic_chunks is None else deterministic_chunks
    fixed, order = _chunking(
        given,
        fit.block_order_given,
        fit.generation_placement,
        sampler=wl.sampler,
        lookahead=new_lookahead,
    )
    workload = replace(
        wl,
        batch=new_batch,
        min_groups=min(wl.min_groups, new_batch),
        lookahead=new_lookahead,
        deterministic_chunks=fixed,
        block_order=order,
    )
    generation = fit.generation
    if engines is not None:
        generation = replace(generation, engines=engines)
    return workload, generation


def simulate_run(
    fit: FittedRun,
    *,
    minimums: Sequence[int] | None = None,
    batch: int | None = None,
    engines: int | None = None,
    lookahead: int | None = None,
    deterministic_chunks: bool | None = None,
    steps: int = 8,
    seed: int = 0,
) -> SimulationTable:
    """The table for the fitted run under the what-if options (see :func:`what_if`)."""
    workload, generation = what_if(
        fit,
        batch=batch,
        engines=engines,
        lookahead=lookahead,
        deterministic_chunks=deterministic_chunks,
    )
    return simulate_minimums(
        workload, generation, fit.costs, fit.lengths, minimums=minimums, steps=steps, seed=seed
    )


def describe(fit: FittedRun) -> str:
    """The fitted numbers, one line each."""
    c, g = fit.costs, fit.generation
    return "\n".join(
        [
            f"fitted on {fit.steps_used} step(s): measured {fit.measured_step_s:.3f} s/step",
            f"  generation: {g.engines} engine(s), {g.concurrency} sequences at once, "
            f"{g.seconds_per_token * 1e3:.1f} ms/token/sequence, batching={g.batching}",
            f"  rows: {_describe_widths(c)}",
            f"  per sample: value forward {c.value_forward_per_sample * 1e3:.2f} ms, actor "
            f"forward+backward {c.actor_train_per_sample * 1e3:.2f} ms, critic epoch "
            f"{c.critic_train_per_sample * 1e3:.2f} ms",
            f"  per step: optimizer {c.optimizer_s:.3f} s x {c.policy_epochs}, refit "
            f"{c.refit_s:.3f} s, other {c.step_overhead_s:.3f} s; per switch "
            f"{c.switch_s:.3f} s; per chunk {c.chunk_overhead_s:.3f} s; per model call "
            f"{c.call_overhead_s * 1e3:.1f} ms",
        ]
    )


def _describe_widths(c: TrainingCosts) -> str:
    if c.scaling == "sample":
        return "every sample costs the same (no chunk widths fitted)"
    return (
        f"costs scale with each pass's padded width (prompt {c.prompt_tokens:.0f} + its "
        f"longest response); per sample of {c.reference_tokens:.1f} tokens"
    )


def main(
    run_dir: Path,
    *,
    minimums: Sequence[int] | None,
    batch: int | None,
    engines: int | None,
    lookahead: int | None,
    streaming: bool,
    steps: int,
    skip_steps: int = 1,
    deterministic_chunks: bool | None = None,
) -> str:
    """What ``ppo-driver simulate`` prints (raises ValueError for bad options)."""
    fit = fit_run(run_dir, skip_steps=skip_steps)
    if not streaming:
        if minimums:
            raise ValueError(
                f"--min-groups={','.join(map(str, minimums))} and --no-streaming contradict: "
                "drop one (--no-streaming simulates the full batch only)"
            )
        minimums = [fit.workload.batch if batch is None else batch]
    table = simulate_run(
        fit,
        minimums=minimums,
        batch=batch,
        engines=engines,
        lookahead=lookahead,
        deterministic_chunks=deterministic_chunks,
        steps=steps,
    )
    return describe(fit) + "\n" + table.format()
