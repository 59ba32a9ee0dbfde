"""Pure placement arithmetic: how many GPU bundles to reserve and where rollout starts.

No Ray import: the driver validates a configuration with these functions before it
starts anything.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "Layout",
    "LayoutError",
    "LayoutProblem",
    "check_streaming_layout",
    "layout_problems",
    "placement_layout",
    "streaming_layout_problems",
]


@dataclasses.dataclass(frozen=True)
class LayoutProblem:
    """One refused input of :func:`placement_layout` (``field``: its parameter name) or of
    :func:`check_streaming_layout` (``field``: ``colocate``): the value, what is wrong, the fix."""

    field: str
    value: object
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r} {self.message}; {self.fix}"


class LayoutError(ValueError):
    """A layout refused, with EVERY problem in ``problems``."""

    def __init__(self, problems: list[LayoutProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """The bundles of the ONE placement group that actor, critic and rollout share.

    Bundle indices here are positions in the *ordered* bundle list (see
    ``SharedPlacement``), not Ray's raw bundle indices.

    Attributes:
        num_gpus: bundles (one GPU each) to reserve.
        rollout_offset: index of the first rollout bundle (0 when colocated: rollout
            shares the training bundles).
        actor_gpus: training bundles, ``[0, actor_gpus)``. The critic never adds
            bundles: critic rank r uses actor rank r's bundle.
        rollout_gpus: rollout bundles, ``[rollout_offset, rollout_offset + rollout_gpus)``
            (0 when generation is external or training runs alone).
        colocate: rollout time-shares the training bundles.
    """

    num_gpus: int
    rollout_offset: int
    actor_gpus: int
    rollout_gpus: int
    colocate: bool

    @property
    def train_bundles(self) -> range:
        """Ordered bundle indices of actor rank r (== critic rank r)."""
        return range(self.actor_gpus)

    @property
    def rollout_bundles(self) -> range:
        """Ordered bundle indices of the local rollout engines."""
        return range(self.rollout_offset, self.rollout_offset + self.rollout_gpus)


def placement_layout(
    *,
    actor_gpus: int,
    rollout_gpus: int,
    colocate: bool = False,
    rollout_external: bool = False,
    train_only: bool = False,
    rollout_only: bool = False,
) -> Layout:
    """Size the shared placement group and find where the rollout bundles start.

    Rules, first match wins:

    ======================================  =====================  ==============
    case                                    num_gpus               rollout_offset
    ======================================  =====================  ==============
    ``train_only``                          actor                  0
    ``rollout_external`` + ``rollout_only``  0                      0
    ``rollout_external``                    actor                  actor
    ``rollout_only``                        rollout                0
    ``colocate``                            max(actor, rollout)    0
    otherwise                               actor + rollout        actor
    ======================================  =====================  ==============

    The critic never adds bundles: it reuses the actor's.

    Args:
        actor_gpus: training GPUs (actor data-parallel ranks; the critic shares them).
        rollout_gpus: GPUs of the local generation engines.
        colocate: generation time-shares the training GPUs.
        rollout_external: generation runs outside this placement group.
        train_only: debug mode, no generation at all.
        rollout_only: debug mode, generation only, no training.

    Raises:
        ValueError: naming the contradictory or impossible inputs and the fix.
    """
    problems = layout_problems(
        actor_gpus=actor_gpus,
        rollout_gpus=rollout_gpus,
        colocate=colocate,
        rollout_external=rollout_external,
        train_only=train_only,
        rollout_only=rollout_only,
    )
    if problems:
        raise LayoutError(problems)
    if train_only:
        return Layout(actor_gpus, 0, actor_gpus, 0, colocate=False)
    if rollout_external:
        if rollout_only:
            return Layout(0, 0, 0, 0, colocate=False)
        return Layout(actor_gpus, actor_gpus, actor_gpus, 0, colocate=False)
    if rollout_only:
        return Layout(rollout_gpus, 0, 0, rollout_gpus, colocate=False)
    if colocate:
        return Layout(max(actor_gpus, rollout_gpus), 0, actor_gpus, rollout_gpus, colocate=True)
    return Layout(actor_gpus + rollout_gpus, actor_gpus, actor_gpus, rollout_gpus, colocate=False)


def check_streaming_layout(layout: Layout, *, streaming: bool) -> None:
    """Reject a colocated rollout when training streams.

    Streaming PPO trains on early chunks while the rest of the batch is still being
    generated, so generation needs GPUs of its own.

    Args:
        layout: from :func:`placement_layout`.
        streaming: the step trains in several chunks (min_groups < num_prompts_per_step).

    Raises:
        ValueError: ``streaming`` with a colocated layout.
    """
    problems = streaming_layout_problems(layout, streaming=streaming)
    if problems:
        raise LayoutError(problems)


def streaming_layout_problems(layout: Layout, *, streaming: bool) -> list[LayoutProblem]:
    """What :func:`check_streaming_layout` refuses, as data (empty: accepted)."""
    if not (streaming and layout.colocate):
        return []
    return [
        LayoutProblem(
            "colocate",
            True,
            "is refused: streaming PPO needs separate generation GPUs, but colocate=True puts "
            f"rollout on the training GPUs (layout: {layout})",
            "set colocate=False (with rollout_gpus for the engines) or train in full-batch "
            "mode (min_groups == num_prompts_per_step)",
        )
    ]


def _gpu_count_problems(name: str, value: object) -> list[LayoutProblem]:
    if isinstance(value, bool) or not isinstance(value, int):
        return [LayoutProblem(name, value, "must be an int", f"set {name} to an int >= 0")]
    if value < 0:
        return [LayoutProblem(name, value, "must be >= 0", f"set {name} to 0 or more")]
    return []


def layout_problems(
    *,
    actor_gpus: object,
    rollout_gpus: object,
    colocate: bool = False,
    rollout_external: bool = False,
    train_only: bool = False,
    rollout_only: bool = False,
) -> list[LayoutProblem]:
    """Every input :func:`placement_layout` refuses, as data, all at once (empty: accepted)."""
    out = _gpu_count_problems("actor_gpus", actor_gpus)
    out += _gpu_count_problems("rollout_gpus", rollout_gpus)
    if train_only and rollout_only:
        out.append(
            LayoutProblem(
                "train_only",
                True,
                "and rollout_only=True contradict each other",
                "set at most one of them",
            )
        )
    if colocate and rollout_external:
        out.append(
            LayoutProblem(
                "colocate",
                True,
                "and rollout_external=True contradict each other: an external rollout cannot "
                "share the training GPUs",
                "set one of them to False",
            )
        )
    if not rollout_only and actor_gpus == 0:
        out.append(
            LayoutProblem(
                "actor_gpus",
                0,
                f"but training is on (rollout_only={rollout_only})",
                "give the actor at least 1 GPU, or set rollout_only=True",
            )
        )
    if not train_only and not rollout_external and rollout_gpus == 0:
        out.append(
            LayoutProblem(
                "rollout_gpus",
                0,
                f"but generation runs locally (train_only={train_only}, "
                f"rollout_external={rollout_external})",
                "give rollout at least 1 GPU, or set rollout_external=True or train_only=True",
            )
        )
    return out
