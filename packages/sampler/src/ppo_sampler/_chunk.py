"""Tail-aware chunk gate: pure functions, no state.

A *group* is one prompt with all its generated responses. A training step consumes
``batch`` groups (``ppo.num_prompts_per_step``); streaming trains on chunks of them as
they finish generating. These functions decide how large each chunk is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = [
    "chunk_schedule",
    "fixed_chunk_sizes",
    "group_alignment",
    "plan_chunk",
    "plan_fixed_chunk",
    "single_chunk_only",
    "tail_floor",
]


def _require_int(func: str, name: str, value: object, *, minimum: int, why: str) -> int:
    """Return ``value`` if it is an ``int`` (not a bool) ``>= minimum``, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{func}: {name}={value!r} must be an int ({why})")
    if value < minimum:
        raise ValueError(f"{func}: {name}={value!r} must be >= {minimum} ({why})")
    return value


def tail_floor(*, min_groups: int) -> int:
    """The fewest groups a non-final chunk may leave behind: ``ceil(min_groups / 2)``."""
    _require_int("tail_floor", "min_groups", min_groups, minimum=1, why="the readiness minimum")
    return -(-min_groups // 2)


def plan_chunk(*, ready: int, remaining: int, min_groups: int, alignment: int = 1) -> int:
    """How many prompt groups to train on now; 0 means wait.

    Args:
        ready: eligible ready groups not yet claimed (``>= 0``).
        remaining: groups of this step not yet consumed (``> 0``, a multiple of ``alignment``).
        min_groups: the readiness minimum ``async_rl.min_groups_for_streaming_train`` (``>= 1``).
        alignment: chunks are multiples of this many groups (see :func:`group_alignment`).

    Rules (the document's "Tail-aware selection"):

    * ``ready >= remaining``: return ``remaining``; the final remainder flushes, even
      below the minimum.
    * otherwise ``take = ready`` rounded down to a multiple of ``alignment``; return 0 if
      ``take < min_groups``, and 0 if it would leave ``0 < remaining - take <
      ceil(min_groups / 2)`` groups (the largest aligned selection is deferred, never
      trimmed). Leaving exactly the tail floor is allowed.

    Raises:
        ValueError: naming the bad argument for negative counts, ``remaining <= 0``,
            ``min_groups < 1``, ``alignment < 1`` or ``remaining % alignment != 0``.
    """
    fn = "plan_chunk"
    _require_int(fn, "ready", ready, minimum=0, why="a count of ready groups")
    _require_int(fn, "remaining", remaining, minimum=1, why="groups of this step not yet consumed")
    _require_int(fn, "min_groups", min_groups, minimum=1, why="the readiness minimum")
    _require_int(fn, "alignment", alignment, minimum=1, why="groups per aligned unit")
    if remaining % alignment:
        raise ValueError(
            f"{fn}: remaining={remaining} is not a multiple of alignment={alignment}; "
            "make the step's batch (ppo.num_prompts_per_step) a multiple of the group alignment"
        )
    if ready >= remaining:
        return remaining
    take = ready - ready % alignment
    if take < min_groups:
        return 0
    left = remaining - take
    if 0 < left < tail_floor(min_groups=min_groups):
        return 0
    return take


def _fixed_block(*, remaining: int, min_groups: int, alignment: int) -> int:
    """The next block of the fixed plan: ``min_groups`` rounded up to ``alignment``, or
    everything left when a block would leave ``0 < left < tail_floor`` (or more than is left)."""
    block = -(-min_groups // alignment) * alignment
    return remaining if remaining - block < tail_floor(min_groups=min_groups) else block


def plan_fixed_chunk(*, ready: int, remaining: int, min_groups: int, alignment: int = 1) -> int:
    """The fixed-position counterpart of :func:`plan_chunk` (``async_rl.deterministic_chunks``).

    A step's groups, in dispatch order, are cut into consecutive blocks whose sizes
    depend only on ``batch``, ``min_groups`` and ``alignment`` (:func:`fixed_chunk_sizes`):
    ``min_groups`` rounded up to a multiple of ``alignment``; the last block is what is
    left, merged into the block before it when it would be below the tail floor
    ``ceil(min_groups / 2)``. Returns the next block's size when its groups are all
    ready (``ready`` counts the step's ready groups in dispatch order), else 0.

    Every block is a chunk :func:`plan_chunk` could also choose (aligned, at least the
    minimum unless final, never leaving less than the tail floor); only the moment
    differs: a block waits for exactly its own groups, not for a count.

    >>> [plan_fixed_chunk(ready=r, remaining=10, min_groups=4) for r in (3, 4, 9)]
    [0, 4, 4]

    Raises:
        ValueError: as :func:`plan_chunk`, for the same arguments.
    """
    plan_chunk(ready=ready, remaining=remaining, min_groups=min_groups, alignment=alignment)
    block = _fixed_block(remaining=remaining, min_groups=min_groups, alignment=alignment)
    return block if ready >= block else 0


def fixed_chunk_sizes(*, batch: int, min_groups: int, alignment: int = 1) -> list[int]:
    """The chunk sizes of every step under ``async_rl.deterministic_chunks``; they sum to
    ``batch`` (see :func:`plan_fixed_chunk`).

    >>> fixed_chunk_sizes(batch=64, min_groups=16), fixed_chunk_sizes(batch=70, min_groups=16)
    ([16, 16, 16, 16], [16, 16, 16, 22])

    Raises:
        ValueError: on a bad ``batch``/``min_groups``/``alignment`` (as :func:`chunk_schedule`).
    """
    _check_batch("fixed_chunk_sizes", batch=batch, min_groups=min_groups, alignment=alignment)
    sizes: list[int] = []
    left = batch
    while left:
        sizes.append(_fixed_block(remaining=left, min_groups=min_groups, alignment=alignment))
        left -= sizes[-1]
    return sizes


def _check_batch(fn: str, *, batch: int, min_groups: int, alignment: int) -> None:
    _require_int(fn, "batch", batch, minimum=1, why="groups per step, ppo.num_prompts_per_step")
    _require_int(fn, "min_groups", min_groups, minimum=1, why="the readiness minimum")
    _require_int(fn, "alignment", alignment, minimum=1, why="groups per aligned unit")
    if min_groups > batch:
        raise ValueError(
            f"{fn}: min_groups={min_groups} exceeds batch={batch}; set it at most the batch "
            "(equal to the batch selects full-batch execution)"
        )
    if batch % alignment:
        raise ValueError(
            f"{fn}: batch={batch} is not a multiple of alignment={alignment}; "
            "choose ppo.num_prompts_per_step as a multiple of the group alignment"
        )


def chunk_schedule(
    ready_counts: Iterable[int], *, batch: int, min_groups: int, alignment: int = 1
) -> list[int]:
    """Replay one step and return its chunk sizes, which sum to ``batch``.

    Args:
        ready_counts: the cumulative number of this step's groups that have finished
            generating, observed at successive polls; non-decreasing, ending at ``batch``.
        batch: groups per step (``ppo.num_prompts_per_step``).
        min_groups: the readiness minimum.
        alignment: the group alignment.

    At each poll :func:`plan_chunk` is applied repeatedly until it returns 0.

    >>> chunk_schedule([88, 120, 128], batch=128, min_groups=32)
    [88, 40]

    Raises:
        ValueError: on a bad ``batch``/``min_groups``/``alignment`` or when
            ``ready_counts`` decreases, leaves ``[0, batch]``, or does not end at ``batch``.
    """
    fn = "chunk_schedule"
    _check_batch(fn, batch=batch, min_groups=min_groups, alignment=alignment)
    chunks: list[int] = []
    consumed = 0
    previous = 0
    last: int | None = None
    for index, count in enumerate(ready_counts):
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= batch:
            raise ValueError(
                f"{fn}: ready_counts[{index}]={count!r} must be an int in [0, batch={batch}]"
            )
        if count < previous:
            raise ValueError(
                f"{fn}: ready_counts[{index}]={count} is below the previous poll's {previous}; "
                "counts are cumulative and must not decrease"
            )
        previous = last = count
        while consumed < batch:
            size = plan_chunk(
                ready=count - consumed,
                remaining=batch - consumed,
                min_groups=min_groups,
                alignment=alignment,
            )
            if size == 0:
                break
            chunks.append(size)
            consumed += size
    if last != batch:
        raise ValueError(
            f"{fn}: ready_counts must end at batch={batch}, got last value {last!r}; "
            "the last poll is the one where the whole step has finished generating"
        )
    assert consumed == batch, "the final poll always flushes the remainder"
    return chunks


def group_alignment(
    *,
    generations_per_prompt: int,
    actor_dp: int,
    critic_dp: int,
    actor_micro_batch: int | None = None,
    critic_micro_batch: int | None = None,
) -> int:
    """The smallest number of prompt groups every chunk must be a multiple of.

    ``g`` groups hold ``g * generations_per_prompt`` samples. They must split evenly over
    ``actor_dp`` and ``critic_dp`` data-parallel ranks and, when a micro-batch size is
    given (no sequence packing), into whole micro-batches on every rank of that model.

    >>> group_alignment(generations_per_prompt=4, actor_dp=2, critic_dp=8, critic_micro_batch=2)
    4

    Raises:
        ValueError: naming any argument that is not a positive int.
    """
    fn = "group_alignment"
    gpp = _require_int(
        fn, "generations_per_prompt", generations_per_prompt, minimum=1, why="samples per group"
    )
    samples = 1
    for dp_name, dp, mb_name, mb in (
        ("actor_dp", actor_dp, "actor_micro_batch", actor_micro_batch),
        ("critic_dp", critic_dp, "critic_micro_batch", critic_micro_batch),
    ):
        unit = _require_int(fn, dp_name, dp, minimum=1, why="data-parallel ranks")
        if mb is not None:
            unit *= _require_int(fn, mb_name, mb, minimum=1, why="samples per micro-batch, or None")
        samples = math.lcm(samples, unit)
    return samples // math.gcd(samples, gpp)


def single_chunk_only(*, batch: int, min_groups: int, alignment: int = 1) -> bool:
    """True when no streaming split is possible: every step runs as one chunk.

    A split needs a first chunk ``t`` that is aligned, ``>= min_groups``, below ``batch``
    and leaves at least ``ceil(min_groups / 2)`` groups. For ``batch=128`` and
    ``alignment=1`` this holds for ``min_groups`` 1..85 and fails for 86..128.

    Raises:
        ValueError: naming the bad argument (non-positive values, ``min_groups > batch``,
            ``batch`` not a multiple of ``alignment``).
    """
    _check_batch("single_chunk_only", batch=batch, min_groups=min_groups, alignment=alignment)
    smallest_first = -(-min_groups // alignment) * alignment
    return batch - smallest_first < tail_floor(min_groups=min_groups)
