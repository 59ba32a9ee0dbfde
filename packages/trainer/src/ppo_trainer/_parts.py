"""The offloadable parts of a worker (``Part``), taken from ppo-lifecycle."""

from __future__ import annotations

import enum

__all__ = ["ALL_PARTS", "KEEP_GRADIENTS", "Part"]

try:
    from ppo_lifecycle import Part
except ImportError:  # pragma: no cover - until ppo-lifecycle exports Part

    class Part(enum.Enum):  # type: ignore[no-redef]
        """What moves on sleep (mirror of ``ppo_lifecycle.Part``)."""

        PARAMETERS = "parameters"
        OPTIMIZER = "optimizer"
        GRADIENTS = "gradients"
        BUFFERS = "buffers"


ALL_PARTS: frozenset[Part] = frozenset(Part)
"""Sleep offloads everything (the default)."""

KEEP_GRADIENTS: frozenset[Part] = frozenset(p for p in Part if p is not Part.GRADIENTS)
"""A keep-gradients sleep: the actor between chunks of one step."""
