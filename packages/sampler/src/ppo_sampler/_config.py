"""Typed sampler configuration, validated with the document's key names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ppo_sampler._samplers import InOrderSampler, ReadyFirstSampler, Sampler

__all__ = ["SAMPLER_NAMES", "SamplerConfig", "make_sampler"]

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


def _int_key(field: str, value: object, *, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{_KEYS[field]}={value!r} is invalid: it must be an int >= {minimum}; {fix}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """Sampler settings; each field documents its configuration key.

    ``min_groups_for_streaming_train == num_prompts_per_step`` selects full-batch
    execution; a smaller minimum streams.
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
        if self.name not in SAMPLER_NAMES:
            raise ValueError(
                f"{_KEYS['name']}={self.name!r} is not a known sampler; choose one of "
                f"{', '.join(map(repr, SAMPLER_NAMES))} (streaming needs one of them)"
            )
        _int_key("num_prompts_per_step", self.num_prompts_per_step, minimum=1, fix="set the batch")
        _int_key(
            "min_groups_for_streaming_train",
            self.min_groups_for_streaming_train,
            minimum=1,
            fix=f"set it between 1 and {_KEYS['num_prompts_per_step']}",
        )
        if self.min_groups_for_streaming_train > self.num_prompts_per_step:
            raise ValueError(
                f"{_KEYS['min_groups_for_streaming_train']}={self.min_groups_for_streaming_train} "
                f"exceeds {_KEYS['num_prompts_per_step']}={self.num_prompts_per_step}; set it at "
                "most the batch (equal to the batch selects full-batch execution)"
            )
        _int_key("max_lookahead_versions", self.max_lookahead_versions, minimum=0, fix="0 or more")
        _int_key("max_staleness_versions", self.max_staleness_versions, minimum=0, fix="0 or more")
        if not isinstance(self.evict_stale, bool):
            raise ValueError(f"{_KEYS['evict_stale']}={self.evict_stale!r} must be true or false")
        self._check_deterministic()

    def _check_deterministic(self) -> None:
        key = _KEYS["deterministic_chunks"]
        if not isinstance(self.deterministic_chunks, bool):
            raise ValueError(f"{key}={self.deterministic_chunks!r} must be true or false")
        if not self.deterministic_chunks:
            return
        # The rule: every group of a step is generated with the weights of the update
        # before it, and each step's chunks are cut in its dispatch order. ready_first picks
        # groups across steps by readiness; a lookahead lets the next step's groups be
        # generated before or after the refit, whichever comes first.
        if self.name != "in_order":
            raise ValueError(
                f"{key}=true needs {_KEYS['name']}=in_order, not {self.name!r} (which trains "
                f"groups in the order they finish, across steps); set {_KEYS['name']}=in_order, "
                f"or {key}=false"
            )
        if self.max_lookahead_versions != 0:
            raise ValueError(
                f"{key}=true needs {_KEYS['max_lookahead_versions']}=0, not "
                f"{self.max_lookahead_versions} (whether a look-ahead group is generated before "
                f"or after the refit depends on timing); set "
                f"{_KEYS['max_lookahead_versions']}=0, or {key}=false"
            )

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
