"""``python -m ppo_sampler``: print a worked streaming schedule.

Replays one step through a real ``in_order`` sampler: at each poll the finished groups
are added and ``select`` decides whether to train a chunk or wait, and why.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ppo_sampler._chunk import plan_chunk, single_chunk_only, tail_floor
from ppo_sampler._samplers import InOrderSampler


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


def main(argv: Sequence[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
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
