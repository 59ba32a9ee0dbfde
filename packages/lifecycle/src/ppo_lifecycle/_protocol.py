"""The lifecycle contract trainer workers implement."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from ._parts import Part

__all__ = ["Offloadable"]


@runtime_checkable
class Offloadable(Protocol):
    """Something that can leave the device and come back, idempotently.

    - ``sleep(parts=...)`` moves the selected parts off the device. Parts already
      asleep are skipped; a sleep that has nothing left to move is a logged
      no-op, never an error (retries are safe).
    - ``wake_up(parts=...)`` brings the selected sleeping parts back (default: all;
      a forward needs only ``FORWARD_PARTS``). On a resident model it only
      re-establishes what a failed retry may have torn down (process groups).
    - ``is_asleep`` is true while any part is off the device.
    """

    def sleep(self, *, parts: Iterable[Part] = ...) -> None:
        """Move ``parts`` off the device (default: all of them)."""
        ...

    def wake_up(self, *, parts: Iterable[Part] = ...) -> None:
        """Bring the sleeping ``parts`` back onto the device (default: all of them)."""
        ...

    @property
    def is_asleep(self) -> bool:
        """Whether any part is currently off the device."""
        ...
