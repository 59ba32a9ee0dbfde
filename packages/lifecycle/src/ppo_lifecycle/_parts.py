"""What can leave the device: the four parts of a trained model."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

__all__ = [
    "ALL_PARTS",
    "BACKWARD_PARTS",
    "FORWARD_PARTS",
    "KEEP_GRADIENTS",
    "Part",
    "normalize_parts",
    "parts_label",
]


class Part(StrEnum):
    """One kind of device memory a trainer owns.

    ``PARAMETERS``: the model's parameters (tied weights count once).
    ``OPTIMIZER``: every tensor in the optimizer's state (Adam moments, step counters).
    ``GRADIENTS``: ``param.grad`` and ``param.main_grad`` (accumulated, not yet applied).
    ``BUFFERS``: the model's registered buffers (norm statistics, rotary caches).
    """

    PARAMETERS = "parameters"
    OPTIMIZER = "optimizer"
    GRADIENTS = "gradients"
    BUFFERS = "buffers"


#: Sleep with everything: the model leaves the device completely.
ALL_PARTS: frozenset[Part] = frozenset(Part)

#: Sleep with everything except the accumulated gradients, which stay on the device
#: (the actor between streaming chunks).
KEEP_GRADIENTS: frozenset[Part] = frozenset(Part) - {Part.GRADIENTS}

#: What a forward pass needs on the device: parameters and buffers (a value or log-prob
#: forward, a refit's export). The optimizer state may stay asleep.
FORWARD_PARTS: frozenset[Part] = frozenset({Part.PARAMETERS, Part.BUFFERS})

#: What a forward + backward needs: the forward's parts and the accumulated gradients.
BACKWARD_PARTS: frozenset[Part] = FORWARD_PARTS | {Part.GRADIENTS}

#: The order parts leave the device in (and come back in reverse).
PART_ORDER: tuple[Part, ...] = (Part.OPTIMIZER, Part.GRADIENTS, Part.BUFFERS, Part.PARAMETERS)


def normalize_parts(parts: Iterable[Part | str]) -> frozenset[Part]:
    """Validate ``parts`` (members of :class:`Part` or their string values).

    Raises:
        ValueError: ``parts`` is empty or names something that is not a part.
    """
    result: set[Part] = set()
    for item in parts:
        try:
            result.add(Part(item))
        except ValueError:
            valid = ", ".join(p.value for p in Part)
            raise ValueError(
                f"parts: {item!r} is not a part; use members of ppo_lifecycle.Part ({valid})"
            ) from None
    if not result:
        raise ValueError(
            "parts: empty selection; pass at least one Part (ALL_PARTS or KEEP_GRADIENTS)"
        )
    return frozenset(result)


def parts_label(parts: frozenset[Part]) -> str:
    """``parts`` as a short label: ``"all"``, ``"keep_grads"`` (all but the gradients), or
    the part names joined by ``+`` in wake-up order (``"parameters+buffers"``)."""
    if parts == ALL_PARTS:
        return "all"
    if parts == KEEP_GRADIENTS:
        return "keep_grads"
    return "+".join(p.value for p in reversed(PART_ORDER) if p in parts)
