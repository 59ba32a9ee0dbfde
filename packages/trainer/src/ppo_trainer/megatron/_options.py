"""The Megatron options of a worker (``backend_options``), validated at set-up.

``ActorConfig.backend_options`` / ``CriticConfig.backend_options`` carry the driver's
``policy.megatron_cfg`` / ``critic.megatron_cfg`` mapping::

    {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
     "use_megatron_fsdp": False, "fp8_param": False, "fp8_recipe": None,
     "optimizer": {"use_distributed_optimizer": False, "overlap_param_gather": False},
     "transformer_impl": "auto", "seed": None}

``transformer_impl``: ``"auto"`` (the Transformer Engine layer spec when TE imports and
CUDA is present, the local spec otherwise), ``"transformer_engine"`` or ``"local"``.
``seed`` defaults to the model spec's seed (megatron's model-parallel RNG seed).
Errors name the key as the driver spells it (``policy.megatron_cfg.<key>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MegatronOptions", "parse_options"]

_TOP_KEYS = {
    "enabled",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "use_megatron_fsdp",
    "fp8_param",
    "fp8_recipe",
    "optimizer",
    "transformer_impl",
    "seed",
}
_OPTIMIZER_KEYS = {"use_distributed_optimizer", "overlap_param_gather"}
_IMPLS = ("auto", "transformer_engine", "local")


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    fp8_param: bool = False
    fp8_recipe: str | None = None
    transformer_impl: str = "auto"
    seed: int | None = None
    prefix: str = "policy.megatron_cfg"


def _bad(key: str, value: object, why: str, fix: str) -> ValueError:
    return ValueError(f"{key}={value!r} is not supported: {why}; {fix}")


def parse_options(options: Mapping[str, Any], *, role: str) -> MegatronOptions:
    """Validate ``options`` (a ``megatron_cfg`` mapping) for ``role`` ("policy"/"critic").

    Raises ``ValueError`` naming ``<role>.megatron_cfg.<key>`` for an unknown key, a
    non-positive parallel size, Megatron FSDP, MXFP8 parameters combined with the
    distributed optimizer, and ``optimizer.overlap_param_gather=true`` (not wired).
    """
    p = f"{role}.megatron_cfg"
    unknown = sorted(set(options) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"{p}.{unknown[0]} is unknown: use only {sorted(_TOP_KEYS)}")
    opt = options.get("optimizer") or {}
    if not isinstance(opt, Mapping):
        raise ValueError(f"{p}.optimizer={opt!r} is invalid: use a mapping")
    unknown = sorted(set(opt) - _OPTIMIZER_KEYS)
    if unknown:
        raise ValueError(
            f"{p}.optimizer.{unknown[0]} is unknown: use only {sorted(_OPTIMIZER_KEYS)}"
        )

    if options.get("use_megatron_fsdp", False):
        raise _bad(
            f"{p}.use_megatron_fsdp",
            True,
            "Megatron FSDP shards parameters and gradients together, so the actor cannot keep "
            "its gradients resident while its parameters sleep between chunks",
            f"set {p}.use_megatron_fsdp=false (classic Megatron DDP)",
        )
    fp8_param = bool(options.get("fp8_param", False))
    recipe = options.get("fp8_recipe")
    distopt = bool(opt.get("use_distributed_optimizer", False))
    if fp8_param and str(recipe or "").lower() == "mxfp8" and distopt:
        raise _bad(
            f"{p}.optimizer.use_distributed_optimizer",
            True,
            f"with MXFP8 parameters ({p}.fp8_param=true, {p}.fp8_recipe='mxfp8') the "
            "distributed optimizer reuses the gradient buffer for the parameter all-gather, "
            "so gradients cannot stay resident while the parameters sleep",
            f"set {p}.optimizer.use_distributed_optimizer=false or {p}.fp8_param=false",
        )
    if bool(opt.get("overlap_param_gather", False)):
        # Overlapping the parameter all-gather with the next forward needs the distributed
        # optimizer plus DDP's forward pre-hooks, and a model that sleeps between chunks
        # would have to drain the pending all-gathers first; none of that is wired, so the
        # option would silently do nothing. Refused instead of ignored.
        why = (
            "the Megatron backend runs the distributed optimizer's parameter all-gather "
            "synchronously inside its step (parameters that sleep between chunks need it in "
            "place), so the option would have no effect"
        )
        if not distopt:
            why = (
                "the parameter all-gather it overlaps exists only with "
                f"{p}.optimizer.use_distributed_optimizer=true, and even then " + why
            )
        raise _bad(
            f"{p}.optimizer.overlap_param_gather",
            True,
            why,
            f"set {p}.optimizer.overlap_param_gather=false",
        )
    sizes: dict[str, int] = {}
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = options.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{p}.{key}={value!r} is invalid: use a positive integer")
        sizes[key] = value
    impl = options.get("transformer_impl", "auto")
    if impl not in _IMPLS:
        raise ValueError(f"{p}.transformer_impl={impl!r} is invalid: use one of {_IMPLS}")
    seed = options.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"{p}.seed={seed!r} is invalid: use an integer or null")
    return MegatronOptions(
        **sizes,
        use_distributed_optimizer=distopt,
        overlap_param_gather=False,  # True is refused above
        fp8_param=fp8_param,
        fp8_recipe=None if recipe is None else str(recipe),
        transformer_impl=impl,
        seed=seed,
        prefix=p,
    )
