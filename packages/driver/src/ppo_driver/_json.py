"""The type of a parsed JSON (or YAML) value, for what the driver reads back from its
own files and from data sets."""

from __future__ import annotations

from typing import SupportsFloat, SupportsIndex, SupportsInt, TypeAlias

JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None
"""Any value ``json.loads`` returns."""

JSONObject: TypeAlias = dict[str, JSONValue]
"""A JSON object (``json.loads`` of ``{...}``)."""


def as_int(value: object) -> int:
    """``int(value)`` of a value read back from JSON (a number, or a numeric string);
    a ``TypeError`` for anything ``int()`` refuses."""
    if isinstance(value, str | SupportsInt | SupportsIndex):
        return int(value)
    raise TypeError(f"int() argument must be a string or a number, not {type(value).__name__!r}")


def as_float(value: object) -> float:
    """``float(value)`` of a value read back from JSON; a ``TypeError`` for anything
    ``float()`` refuses."""
    if isinstance(value, str | SupportsFloat | SupportsIndex):
        return float(value)
    raise TypeError(f"float() argument must be a string or a number, not {type(value).__name__!r}")
