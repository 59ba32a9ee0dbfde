"""The report: one :class:`ConfigProblem` per problem (key, value, message, fix), the
:class:`ConfigError` listing all of them, and :class:`ValidConfig`, what ``train`` runs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ppo_driver.config.schema import DriverConfig, freeze

if TYPE_CHECKING:
    from ppo_driver.workload import Workload


@dataclass(frozen=True)
class ConfigProblem:
    """One configuration problem: the key, the value, what is wrong and how to fix it."""

    key: str
    value: object
    message: str
    fix: str
    severity: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}={self.value!r}: {self.message}; fix: {self.fix}"


def must_be(key: str, value: object, rule: str, example: object = None) -> ConfigProblem:
    """``key`` must be ``rule`` (a range, a set of names), e.g. ``example``."""
    eg = "" if example is None else f", e.g. {example}"
    return ConfigProblem(key, value, f"must be {rule}", f"set {key} to a value {rule}{eg}")


def warning(key: str, value: object, message: str, fix: str) -> ConfigProblem:
    """A :class:`ConfigProblem` that does not refuse the config."""
    return ConfigProblem(key, value, message, fix, severity="warning")


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
    # A copy of the config validate() judged (None: a report built by hand), and the
    # workload it loaded (tokenizer, data, reward: what train would load again).
    judged: DriverConfig | None = field(default=None, repr=False, compare=False)
    workload: Workload | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, key: str, value: object, message: str, fix: str) -> None:
        self.errors.append(ConfigProblem(key, value, message, fix))

    def warn(self, key: str, value: object, message: str, fix: str) -> None:
        self.warnings.append(warning(key, value, message, fix))

    def add(self, problems: Iterable[ConfigProblem]) -> None:
        """Each problem into ``errors`` or ``warnings`` by its severity."""
        for p in problems:
            (self.warnings if p.severity == "warning" else self.errors).append(p)

    def refused(self, key: str) -> bool:
        """Whether an error names ``key`` already (one problem per key is enough)."""
        return any(p.key == key for p in self.errors)

    def raise_if_errors(self) -> None:
        if self.errors:
            raise ConfigError(self.errors)

    def valid(self) -> ValidConfig:
        """The config this report accepted, as a :class:`ValidConfig` (what ``train``
        takes); :class:`ConfigError` with every error when it has any."""
        self.raise_if_errors()
        if self.judged is None:
            raise ValueError("this report was not made by validate(): call validate(cfg)")
        return ValidConfig(copy.deepcopy(self.judged), tuple(self.warnings), self.workload)


@dataclass(frozen=True)
class ValidConfig:
    """A :class:`DriverConfig` that :func:`validate` accepted, and its warnings: what
    ``ppo_driver.train`` runs. Made by :func:`validated` or ``ValidationReport.valid``
    (from a copy taken when it was judged, so a later edit of the original cannot bypass
    the checks); its ``.config`` is frozen, sections included (the ``rollout.extra`` and
    ``engine_kwargs`` mappings excepted)."""

    config: DriverConfig
    warnings: tuple[ConfigProblem, ...] = ()
    # validate's workload, loaded once: train uses it (None: train loads it)
    workload: Workload | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        freeze(self.config)


def _non_finite_problem(key: str, value: object) -> ConfigProblem:
    return ConfigProblem(
        key,
        value,
        "must be a finite number (NaN and infinity are refused)",
        f"set {key} to a finite number",
    )
