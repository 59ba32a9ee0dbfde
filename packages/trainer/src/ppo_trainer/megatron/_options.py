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

from ppo_trainer._megatron_rules import MegatronConfigError, option_problems

__all__ = ["MegatronOptions", "parse_options"]


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


def parse_options(options: Mapping[str, Any], *, role: str) -> MegatronOptions:
    """Validate ``options`` (a ``megatron_cfg`` mapping) for ``role`` ("policy"/"critic").

    The rules are :func:`ppo_trainer.option_problems` (no megatron import: the driver's
    validate asks them too). Raises :class:`ppo_trainer.MegatronConfigError` (a
    ``ValueError``) naming ``<role>.megatron_cfg.<key>`` for EVERY refused option: an
    unknown key, a non-positive parallel size, Megatron FSDP, MXFP8 parameters combined
    with the distributed optimizer, ``optimizer.overlap_param_gather=true`` (not wired).
    """
    p = f"{role}.megatron_cfg"
    problems = [q for q in option_problems(options, prefix=p) if q.severity == "error"]
    if problems:
        raise MegatronConfigError(problems)
    opt = options.get("optimizer") or {}
    recipe = options.get("fp8_recipe")
    return MegatronOptions(
        tensor_model_parallel_size=options.get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=options.get("pipeline_model_parallel_size", 1),
        use_distributed_optimizer=bool(opt.get("use_distributed_optimizer", False)),
        overlap_param_gather=False,  # True is refused by option_problems
        fp8_param=bool(options.get("fp8_param", False)),
        # the rules accept any case; megatron-core compares lowercase names
        fp8_recipe=None if recipe is None else str(recipe).lower(),
        transformer_impl=options.get("transformer_impl", "auto"),
        seed=options.get("seed"),
        prefix=p,
    )
