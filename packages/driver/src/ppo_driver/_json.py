"""The type of a parsed JSON (or YAML) value, for what the driver reads back from its
own files and from data sets."""

from __future__ import annotations

from typing import TypeAlias

JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None
"""Any value ``json.loads`` returns."""

JSONObject: TypeAlias = dict[str, JSONValue]
"""A JSON object (``json.loads`` of ``{...}``)."""
