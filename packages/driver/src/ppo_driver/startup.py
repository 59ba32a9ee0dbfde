"""What ``train`` and ``validate`` both check before anything starts, without loading
torch or Ray: the crash-drill variable and the start-up refusal."""

from __future__ import annotations

__all__ = ["FAIL_ENV", "FAIL_POINTS", "StartupError", "parse_fail_at"]

FAIL_ENV = "PPO_DRIVER_FAIL_AT"
"""``<step>:<point>`` makes the driver crash at a named point (tests, crash drills)."""

FAIL_POINTS = ("after_chunks", "after_policy_update", "before_critic", "after_step", "checkpoint")
"""The points :data:`FAIL_ENV` can name."""


class StartupError(ValueError):
    """A run refused before anything started (no Ray, no workers; the message says what
    and how to fix it)."""


def parse_fail_at(value: str | None) -> str | None:
    """``"<step>:<point>"`` (a crash drill), normalised; ``None`` or ``""``: no drill.
    Anything else is refused (a typo must not silently run without the drill)."""
    if not value:
        return None
    step, sep, point = value.partition(":")
    if not (sep and step.strip().isdigit() and point in FAIL_POINTS):
        raise StartupError(
            f"{FAIL_ENV}={value!r} is not '<step>:<point>' with a step number and one of "
            f"{', '.join(FAIL_POINTS)} (e.g. '1:before_critic'); fix it or unset it"
        )
    return f"{int(step)}:{point}"
