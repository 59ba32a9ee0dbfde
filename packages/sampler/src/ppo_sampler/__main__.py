"""``python -m ppo_sampler``: print a worked streaming schedule.

Replays one step through a real ``in_order`` sampler: at each poll the finished groups
are added and ``select`` decides whether to train a chunk or wait, and why.

``python -m ppo_sampler simulate [--preset 7b-8gpu] [options]``: the step simulator's
table (:func:`ppo_sampler.simulate_minimums`) for a scale preset, any of whose inputs
the options replace; ``--json`` prints it as data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from ppo_sampler._chunk import plan_chunk, single_chunk_only, tail_floor
from ppo_sampler._presets import PRESETS
from ppo_sampler._samplers import InOrderSampler
from ppo_sampler._simulate import (
    GenerationModel,
    LognormalLengths,
    MeasuredLengths,
    TrainingCosts,
    Workload,
    simulate_minimums,
)


def _why_wait(*, ready: int, remaining: int, min_groups: int, alignment: int) -> str:
    take = ready - ready % alignment
    if take < min_groups:
        return f"wait: {take} aligned ready < minimum {min_groups}"
    return (
        f"wait: {take} would leave {remaining - take} < tail floor "
        f"{tail_floor(min_groups=min_groups)}; defer, never trim"
    )


def replay(*, polls: Sequence[int], batch: int, min_groups: int, alignment: int) -> list[str]:
    """Lines describing one step replayed through :class:`InOrderSampler`."""
    sampler = InOrderSampler(max_lookahead_versions=1)
    lines = [
        f"step 0: batch={batch} min_groups={min_groups} alignment={alignment} "
        f"tail_floor={tail_floor(min_groups=min_groups)}"
    ]
    added = claimed = 0
    chunks: list[int] = []
    for poll, finished in enumerate(polls, start=1):
        for group_id in range(added, finished):
            sampler.add(group_id, step=0, weight_version=0)
        added = max(added, finished)
        trained_this_poll = False
        while claimed < batch:
            ready, remaining = added - claimed, batch - claimed
            ids = sampler.select(
                trainer_step=0,
                trainer_version=0,
                remaining=remaining,
                min_groups=min_groups,
                alignment=alignment,
            )
            assert len(ids) == plan_chunk(
                ready=ready, remaining=remaining, min_groups=min_groups, alignment=alignment
            )
            head = (
                f"  poll {poll}: {finished:>4} finished, {ready:>4} ready, {remaining:>4} left -> "
            )
            if not ids:
                if trained_this_poll:
                    break
                why = _why_wait(
                    ready=ready, remaining=remaining, min_groups=min_groups, alignment=alignment
                )
                lines.append(head + why)
                break
            final = " (final remainder)" if len(ids) == remaining else ""
            lines.append(head + f"train chunk of {len(ids)} (groups {ids[0]}..{ids[-1]}){final}")
            chunks.append(len(ids))
            trained_this_poll = True
            claimed += len(ids)
    sampler.mark_consumed(sampler.claimed())
    lines.append(f"  chunks: {' + '.join(map(str, chunks))} = {sum(chunks)}")
    return lines


_WORKLOAD_FLAGS = {
    "batch": "batch",
    "samples_per_group": "samples_per_group",
    "alignment": "alignment",
    "sampler": "sampler",
    "lookahead": "lookahead",
    "max_in_flight": "max_in_flight",
    "groups_per_call": "groups_per_call",
    "block_order": "block_order",
}
_WORKLOAD_SWITCHES = {
    "deterministic_chunks": "async_rl.deterministic_chunks: fixed blocks, each once all its groups are done",
    "merge_ready_blocks": "async_rl.merge_ready_blocks: every ready fixed block in one chunk",
}
_COST_SWITCHES = {
    "logprob_pass": "full batch with K > 1 policy epochs: a separate log-prob forward before "
    "epoch 1 (verl's, OpenRLHF's; ppo-driver's before 0.8.1)",
}
_GENERATION_FLAGS = ("tokens_per_s", "concurrency", "engines", "batching", "latency_s")
_COST_FLAGS = {
    "value_forward": "value_forward_per_sample",
    "actor_train": "actor_train_per_sample",
    "actor_forward": "actor_forward_per_sample",
    "critic_train": "critic_train_per_sample",
    "critic_epochs": "critic_epochs",
    "policy_epochs": "policy_epochs",
    "optimizer_s": "optimizer_s",
    "refit_s": "refit_s",
    "switch_s": "switch_s",
    "chunk_overhead_s": "chunk_overhead_s",
    "step_overhead_s": "step_overhead_s",
    "call_overhead_s": "call_overhead_s",
    "scaling": "scaling",
    "reference_tokens": "reference_tokens",
    "prompt_tokens": "prompt_tokens",
}


def _simulate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ppo_sampler simulate",
        description="Project step times, streaming against full batch, for each minimum "
        "(a simulation driven by the real sampler; not a measurement).",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b-8gpu")
    p.add_argument("--min-groups", default=None, help="minimums, comma separated (default: sweep)")
    p.add_argument("--steps", type=int, default=8, help="simulated steps (the first warms up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the table as JSON data")
    p.add_argument("--lengths", default=None, help="measured response lengths, comma separated")
    p.add_argument("--lognormal", default=None, metavar="MEDIAN,SIGMA,MAX", help="length model")
    kind: type[str] | type[int] | type[float]
    for flag in _WORKLOAD_FLAGS:
        kind = str if flag in ("sampler", "block_order") else int
        p.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None)
    for flag in _GENERATION_FLAGS:
        kind = str if flag == "batching" else int if flag in ("concurrency", "engines") else float
        p.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None)
    for flag in _COST_FLAGS:
        kind = int if flag.endswith("epochs") else str if flag == "scaling" else float
        help_ = "seconds per sample" if flag in ("value_forward", "actor_train", "actor_forward",
                                                  "critic_train") else None  # fmt: skip
        if flag == "scaling":
            help_ = "sample, padded or packed: how a pass's work follows its lengths"
        p.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None, help=help_)
    for flag, what in {**_WORKLOAD_SWITCHES, **_COST_SWITCHES}.items():
        p.add_argument(
            f"--{flag.replace('_', '-')}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{what} (default: the preset's, off)",
        )
    return p


def _replaced(obj: Any, args: argparse.Namespace, flags: dict[str, str]) -> Any:
    given = {field: getattr(args, flag) for flag, field in flags.items()}
    return dataclasses.replace(obj, **{k: v for k, v in given.items() if v is not None})


def simulate_main(argv: Sequence[str]) -> int:
    """``python -m ppo_sampler simulate``; bad inputs exit 2 with the simulator's message."""
    parser = _simulate_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    try:
        shape = dataclasses.asdict(preset.workload)
        flags = [*_WORKLOAD_FLAGS, *_WORKLOAD_SWITCHES]
        shape.update({k: getattr(args, k) for k in flags if getattr(args, k) is not None})
        shape["min_groups"] = min(shape["min_groups"], shape["batch"])  # a smaller --batch
        workload = Workload(**shape)
        generation: GenerationModel = _replaced(
            preset.generation, args, {f: f for f in _GENERATION_FLAGS}
        )
        costs: TrainingCosts = _replaced(
            preset.costs, args, {**_COST_FLAGS, **{f: f for f in _COST_SWITCHES}}
        )
        lengths: LognormalLengths | MeasuredLengths = preset.lengths
        if args.lengths is not None:
            lengths = MeasuredLengths(lengths=tuple(int(n) for n in args.lengths.split(",") if n))
        if args.lognormal is not None:
            median, sigma, top = args.lognormal.split(",")
            lengths = LognormalLengths(
                median=float(median), sigma=float(sigma), max_tokens=int(top)
            )
        minimums = None if args.min_groups is None else [int(m) for m in args.min_groups.split(",")]
        table = simulate_minimums(
            workload,
            generation,
            costs,
            lengths,
            minimums=minimums,
            steps=args.steps,
            seed=args.seed,
        )
    except ValueError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps(table.as_dict(), indent=1))
    else:
        print(f"preset {args.preset}: {preset.description}")
        print(table.format())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["simulate"]:
        return simulate_main(args_in[1:])
    parser = argparse.ArgumentParser(
        prog="python -m ppo_sampler", description="Print a worked tail-aware streaming schedule."
    )
    parser.add_argument("--batch", type=int, default=128, help="ppo.num_prompts_per_step")
    parser.add_argument("--min-groups", type=int, default=32, help="readiness minimum")
    parser.add_argument("--alignment", type=int, default=1, help="group alignment")
    parser.add_argument(
        "--polls",
        default="20,88,120,128",
        help="cumulative finished groups at each poll, comma separated, ending at the batch",
    )
    args = parser.parse_args(args_in)
    try:
        polls = [int(p) for p in args.polls.split(",")]
        if not polls or polls[-1] != args.batch or polls != sorted(polls):
            raise ValueError(f"--polls={args.polls!r} must be non-decreasing and end at --batch")
        batch, low, align = args.batch, args.min_groups, args.alignment
        single = single_chunk_only(batch=batch, min_groups=low, alignment=align)
        lines = replay(polls=polls, batch=batch, min_groups=low, alignment=align)
    except ValueError as err:
        parser.error(str(err))
    print("\n".join(lines))
    mode = "full-batch" if low == batch else "one chunk per step" if single else "streaming"
    print(f"mode: {mode} (single_chunk_only={single})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
