"""The report: one :class:`ConfigProblem` per problem (key, value, message, fix), the
:class:`ConfigError` listing all of them, and :class:`ValidConfig`, what ``train`` runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_driver.config.schema import DriverConfig, freeze


@dataclass(frozen=True)
class ConfigProblem:
    """One configuration problem: the key, the value, what is wrong and how to fix it."""

    key: str
    value: Any
    message: str
    fix: str
    severity: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}={self.value!r}: {self.message}; fix: {self.fix}"


class ConfigError(ValueError):
    """Raised with EVERY problem found, not only the first."""

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = list(problems)
        lines = [f"{len(self.problems)} configuration problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


@dataclass
class ValidationReport:
    errors: list[ConfigProblem] = field(default_factory=list)
    warnings: list[ConfigProblem] = field(default_factory=list)
    # A copy of the config validate() judged (None: a report built by hand).
    judged: DriverConfig | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_if_errors(self) -> None:
        if self.errors:
            raise ConfigError(self.errors)

    def valid(self) -> ValidConfig:
        """The config this report accepted, as a :class:`ValidConfig` (what ``train``
        takes); :class:`ConfigError` with every error when it has any."""
        self.raise_if_errors()
        if self.judged is None:
            raise ValueError("this report was not made by validate(): call validate(cfg)")
        return ValidConfig(copy.deepcopy(self.judged), tuple(self.warnings))


@dataclass(frozen=True)
class ValidConfig:
    """A :class:`DriverConfig` that :func:`validate` accepted, and its warnings: what
    ``ppo_driver.train`` runs. Made by :func:`validated` or ``ValidationReport.valid``
    (from a copy taken when it was judged, so a later edit of the original cannot bypass
    the checks); its ``.config`` is frozen, sections included (the ``rollout.extra`` and
    ``engine_kwargs`` mappings excepted)."""

    config: DriverConfig
    warnings: tuple[ConfigProblem, ...] = ()

    def __post_init__(self) -> None:
        freeze(self.config)


def _non_finite_problem(key: str, value: Any) -> ConfigProblem:
    return ConfigProblem(
        key,
        value,
        "must be a finite number (NaN and infinity are refused)",
        f"set {key} to a finite number",
    )
