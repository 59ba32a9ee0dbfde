"""Typed sampler configuration, validated with the document's key names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ppo_sampler._samplers import InOrderSampler, ReadyFirstSampler, Sampler

__all__ = ["SAMPLER_NAMES", "SamplerConfig", "SamplerConfigError", "SamplerProblem", "make_sampler"]

SAMPLER_NAMES = ("in_order", "ready_first")
"""The samplers streaming supports (``async_rl.sampler.name``)."""

_KEYS = {
    "name": "async_rl.sampler.name",
    "max_lookahead_versions": "async_rl.sampler.max_lookahead_versions",
    "max_staleness_versions": "async_rl.sampler.max_staleness_versions",
    "evict_stale": "async_rl.sampler.evict_stale",
    "min_groups_for_streaming_train": "async_rl.min_groups_for_streaming_train",
    "deterministic_chunks": "async_rl.deterministic_chunks",
    "num_prompts_per_step": "ppo.num_prompts_per_step",
}


@dataclasses.dataclass(frozen=True)
class SamplerProblem:
    """One refused :class:`SamplerConfig` field: its name (``field``, the dataclass's), the
    value, what is wrong and the fix. ``key`` is the document's YAML key of the field."""

    field: str
    value: object
    message: str
    fix: str

    @property
    def key(self) -> str:
        return _KEYS[self.field]

    def __str__(self) -> str:
        shown = str(self.value).lower() if isinstance(self.value, bool) else repr(self.value)
        return f"{self.key}={shown} {self.message}; {self.fix}"


class SamplerConfigError(ValueError):
    """A :class:`SamplerConfig` refused, with EVERY problem in ``problems``."""

    def __init__(self, problems: list[SamplerProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def _int_problem(field: str, value: object, *, minimum: int, fix: str) -> list[SamplerProblem]:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return [SamplerProblem(field, value, f"is invalid: it must be an int >= {minimum}", fix)]
    return []


def _bool_problem(field: str, value: object) -> list[SamplerProblem]:
    if isinstance(value, bool):
        return []
    return [
        SamplerProblem(
            field, value, "must be true or false", f"set {_KEYS[field]} to true or false"
        )
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """Sampler settings; each field documents its configuration key.

    ``min_groups_for_streaming_train == num_prompts_per_step`` selects full-batch
    execution; a smaller minimum streams. :meth:`problems` judges field values without
    building one; the constructor raises :class:`SamplerConfigError` with all of them.
    """

    num_prompts_per_step: int
    """``ppo.num_prompts_per_step``: prompt groups per training step (the batch)."""
    min_groups_for_streaming_train: int
    """``async_rl.min_groups_for_streaming_train``: the readiness minimum per chunk."""
    name: str = "in_order"
    """``async_rl.sampler.name``: ``in_order`` or ``ready_first``."""
    max_lookahead_versions: int = 1
    """``async_rl.sampler.max_lookahead_versions`` (``in_order``): steps generation may run ahead."""
    max_staleness_versions: int = 1
    """``async_rl.sampler.max_staleness_versions`` (``ready_first``): eligible version lag."""
    evict_stale: bool = False
    """``async_rl.sampler.evict_stale`` (``ready_first``): drop too-stale groups for re-dispatch."""
    deterministic_chunks: bool = False
    """``async_rl.deterministic_chunks``: cut every step into the fixed blocks of
    :func:`ppo_sampler.fixed_chunk_sizes`, released in order as each is complete, so chunk
    composition depends on the seed and config only. Needs ``in_order`` with
    ``max_lookahead_versions=0`` (no group is generated before the previous update)."""

    def __post_init__(self) -> None:
        problems = self.problems(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )
        if problems:
            raise SamplerConfigError(problems)

    @classmethod
    def problems(
        cls,
        *,
        num_prompts_per_step: object,
        min_groups_for_streaming_train: object,
        name: object = "in_order",
        max_lookahead_versions: object = 1,
        max_staleness_versions: object = 1,
        evict_stale: object = False,
        deterministic_chunks: object = False,
    ) -> list[SamplerProblem]:
        """Every problem of these field values at once (empty: a valid config)."""
        out: list[SamplerProblem] = []
        if name not in SAMPLER_NAMES:
            out.append(
                SamplerProblem(
                    "name",
                    name,
                    "is not a known sampler",
                    f"choose one of {', '.join(map(repr, SAMPLER_NAMES))} (streaming needs one "
                    "of them)",
                )
            )
        batch_key = _KEYS["num_prompts_per_step"]
        out += _int_problem(
            "num_prompts_per_step",
            num_prompts_per_step,
            minimum=1,
            fix=f"set {batch_key} to 1 or more",
        )
        out += _min_groups_problems(num_prompts_per_step, min_groups_for_streaming_train)
        for field in ("max_lookahead_versions", "max_staleness_versions"):
            value = (
                max_lookahead_versions
                if field == "max_lookahead_versions"
                else max_staleness_versions
            )
            out += _int_problem(field, value, minimum=0, fix=f"set {_KEYS[field]} to 0 or more")
        out += _bool_problem("evict_stale", evict_stale)
        out += _deterministic_problems(deterministic_chunks, name, max_lookahead_versions)
        return out

    @property
    def full_batch(self) -> bool:
        """True when the minimum equals the batch: one chunk per step, several epochs allowed."""
        return self.min_groups_for_streaming_train == self.num_prompts_per_step

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> SamplerConfig:
        """Read the nested layout of the document's YAML::

            ppo: {num_prompts_per_step: 256}
            async_rl:
              min_groups_for_streaming_train: 32   # absent: full batch
              deterministic_chunks: false          # absent: false
              sampler: {name: in_order, max_lookahead_versions: 1}

        Other keys under ``ppo`` and ``async_rl`` belong to the driver and are ignored;
        an unknown key under ``async_rl.sampler`` raises ValueError naming it.
        """
        ppo = _section(config, "ppo")
        async_rl = _section(config, "async_rl")
        sampler = _section(async_rl, "sampler", prefix="async_rl.")
        allowed = sorted(f for f, k in _KEYS.items() if k.startswith("async_rl.sampler."))
        for key in sampler:
            if key not in allowed:
                raise ValueError(
                    f"async_rl.sampler.{key} is not a sampler setting; known: {', '.join(allowed)}"
                )
        if "num_prompts_per_step" not in ppo:
            raise ValueError(f"{_KEYS['num_prompts_per_step']} is required")
        batch = ppo["num_prompts_per_step"]
        return cls(
            num_prompts_per_step=batch,
            min_groups_for_streaming_train=async_rl.get("min_groups_for_streaming_train", batch),
            deterministic_chunks=async_rl.get("deterministic_chunks", False),
            **sampler,
        )


def _min_groups_problems(batch: object, minimum: object) -> list[SamplerProblem]:
    field, batch_key = "min_groups_for_streaming_train", _KEYS["num_prompts_per_step"]
    out = _int_problem(field, minimum, minimum=1, fix=f"set it between 1 and {batch_key}")
    if out or isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        return out
    assert isinstance(minimum, int)  # checked by _int_problem
    if minimum > batch:
        out.append(
            SamplerProblem(
                field,
                minimum,
                f"exceeds {batch_key}={batch}",
                "set it at most the batch (equal to the batch selects full-batch execution)",
            )
        )
    return out


def _deterministic_problems(
    deterministic: object, name: object, lookahead: object
) -> list[SamplerProblem]:
    # The rule: every group of a step is generated with the weights of the update before
    # it, and each step's chunks are cut in its dispatch order. ready_first picks groups
    # across steps by readiness; a lookahead lets the next step's groups be generated
    # before or after the refit, whichever comes first.
    field, key = "deterministic_chunks", _KEYS["deterministic_chunks"]
    out = _bool_problem(field, deterministic)
    if out or not deterministic:
        return out
    if name != "in_order":
        out.append(
            SamplerProblem(
                field,
                True,
                f"needs {_KEYS['name']}=in_order, not {name!r} (which trains groups in the "
                "order they finish, across steps)",
                f"set {_KEYS['name']}=in_order, or {key}=false",
            )
        )
    if name == "in_order" and lookahead != 0:
        ahead = _KEYS["max_lookahead_versions"]
        out.append(
            SamplerProblem(
                field,
                True,
                f"needs {ahead}=0, not {lookahead} (whether a look-ahead group is generated "
                "before or after the refit depends on timing)",
                f"set {ahead}=0, or {key}=false",
            )
        )
    return out


def _section(config: Mapping[str, Any], key: str, *, prefix: str = "") -> Mapping[str, Any]:
    value = config.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{prefix}{key} must be a mapping, got {type(value).__name__}")
    return value


def make_sampler(config: SamplerConfig) -> Sampler:
    """Build the sampler ``config.name`` names, with its settings."""
    if config.name == "in_order":
        return InOrderSampler(
            max_lookahead_versions=config.max_lookahead_versions,
            fixed_chunks=config.deterministic_chunks,
        )
    return ReadyFirstSampler(
        max_staleness_versions=config.max_staleness_versions, evict_stale=config.evict_stale
    )
