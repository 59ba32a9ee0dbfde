"""The offloadable parts of a worker, re-exported from ppo-lifecycle."""

from __future__ import annotations

from collections.abc import Iterable

from ppo_lifecycle import ALL_PARTS, KEEP_GRADIENTS, Part

__all__ = ["ALL_PARTS", "KEEP_GRADIENTS", "Part", "parts_from"]


def parts_from(parts: Iterable[Part | str] | None) -> frozenset[Part]:
    """Validate a ``parts=`` argument (``None``: every part)."""
    if parts is None:
        return ALL_PARTS
    out: set[Part] = set()
    for item in parts:
        try:
            out.add(Part(item))
        except ValueError:
            raise ValueError(
                f"parts={item!r} is invalid: use members of ppo_lifecycle.Part "
                f"({', '.join(p.value for p in Part)})"
            ) from None
    if not out:
        raise ValueError(
            "parts=() is invalid: pass at least one Part (ALL_PARTS or KEEP_GRADIENTS)"
        )
    return frozenset(out)
