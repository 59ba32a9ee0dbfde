"""The Megatron backend's rules, written once, as data, WITHOUT importing megatron-core.

:func:`option_problems` judges a ``backend_options`` mapping (the driver's
``<role>.megatron_cfg``) and :func:`mesh_problems` the parallel mesh (``tp * pp`` divides
the ranks; ``tp`` the heads, key/value heads and vocabulary; ``pp`` the layers). The
backend raises :class:`MegatronConfigError` with them at set-up
(``ppo_trainer.megatron.parse_options``, model-parallel initialisation, the transformer
config); ``ppo-driver validate`` asks the same functions before anything starts. Each
:class:`MegatronProblem` names its field as the ``megatron_cfg`` mapping spells it
(``optimizer.overlap_param_gather``); ``prefix`` only words the messages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FP8_RECIPES",
    "MEGATRON_OPTIMIZER_KEYS",
    "MEGATRON_OPTION_KEYS",
    "TRANSFORMER_IMPLS",
    "MegatronConfigError",
    "MegatronProblem",
    "data_parallel_size",
    "mesh_problems",
    "option_problems",
]

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""megatron-core's FP8 recipes the backend can build (``custom`` needs a quantizer
factory it does not pass); ``fp8_recipe: None`` means ``delayed``."""
TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
MEGATRON_OPTION_KEYS = (
    "enabled",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "use_megatron_fsdp",
    "fp8_param",
    "fp8_recipe",
    "optimizer",
    "transformer_impl",
    "seed",
)
MEGATRON_OPTIMIZER_KEYS = ("use_distributed_optimizer", "overlap_param_gather")
_TE = "needs CUDA and the extra ppo-trainer[te]: not available on this machine"


@dataclass(frozen=True)
class MegatronProblem:
    """One refused Megatron option or mesh size: ``field`` as ``megatron_cfg`` spells it."""

    field: str
    value: object
    message: str
    fix: str
    severity: str = "error"  # "error" | "warning"
    prefix: str = "megatron_cfg"

    def __str__(self) -> str:
        return f"{self.prefix}.{self.field}={self.value!r} is not supported: {self.message}; {self.fix}"


class MegatronConfigError(ValueError):
    """Megatron options or a mesh refused, with EVERY error in ``problems``."""

    def __init__(self, problems: list[MegatronProblem]) -> None:
        self.problems = [p for p in problems if p.severity == "error"]
        super().__init__("\n".join(map(str, self.problems)))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def option_problems(
    options: Mapping[str, Any],
    *,
    prefix: str = "megatron_cfg",
    te_available: bool | None = None,
) -> list[MegatronProblem]:
    """Every problem of ``options`` (a ``megatron_cfg`` mapping), errors and warnings.

    ``te_available``: whether Transformer Engine and CUDA are usable here (then the layer
    spec rules are judged too); None leaves them to the backend's set-up.
    """
    p = prefix

    def bad(field: str, value: object, why: str, fix: str, severity: str = "error") -> None:
        out.append(MegatronProblem(field, value, why, fix, severity, p))

    out: list[MegatronProblem] = []
    for name in sorted(set(options) - set(MEGATRON_OPTION_KEYS)):
        bad(name, options[name], "unknown key", f"use only {sorted(MEGATRON_OPTION_KEYS)}")
    opt = options.get("optimizer") or {}
    if not isinstance(opt, Mapping):
        bad("optimizer", opt, "must be a mapping", f"write {p}.optimizer: {{...}}")
        opt = {}
    for name in sorted(set(opt) - set(MEGATRON_OPTIMIZER_KEYS)):
        bad(
            f"optimizer.{name}",
            opt[name],
            "unknown key",
            f"use only {sorted(MEGATRON_OPTIMIZER_KEYS)}",
        )
    if options.get("use_megatron_fsdp", False):
        bad(
            "use_megatron_fsdp",
            True,
            "Megatron FSDP shards parameters and gradients together, so the actor cannot keep "
            "its gradients resident while its parameters sleep between chunks",
            f"set {p}.use_megatron_fsdp=false (classic Megatron DDP)",
        )
    out += _optimizer_problems(options, opt, p)
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = options.get(key, 1)
        if not _is_int(value) or value < 1:
            bad(key, value, "must be a positive integer", f"set {p}.{key} to a positive integer")
    impl = options.get("transformer_impl", "auto")
    if impl not in TRANSFORMER_IMPLS:
        bad("transformer_impl", impl, "unknown layer spec", f"use one of {TRANSFORMER_IMPLS}")
    seed = options.get("seed")
    if seed is not None and not _is_int(seed):
        bad("seed", seed, "must be an integer", "use an integer or null")
    out += _fp8_problems(options, p, te_available)
    return out


def _optimizer_problems(
    options: Mapping[str, Any], opt: Mapping[str, Any], p: str
) -> list[MegatronProblem]:
    """MXFP8 parameters with the distributed optimizer; ``overlap_param_gather``."""
    out: list[MegatronProblem] = []
    distopt = bool(opt.get("use_distributed_optimizer", False))
    mxfp8 = str(options.get("fp8_recipe") or "").lower() == "mxfp8"
    if bool(options.get("fp8_param", False)) and mxfp8 and distopt:
        why = (
            f"with MXFP8 parameters ({p}.fp8_param=true, {p}.fp8_recipe='mxfp8') the "
            "distributed optimizer reuses the gradient buffer for the parameter all-gather, "
            "so gradients cannot stay resident while the parameters sleep"
        )
        fix = f"set {p}.optimizer.use_distributed_optimizer=false or {p}.fp8_param=false"
        out.append(MegatronProblem("optimizer.use_distributed_optimizer", True, why, fix, prefix=p))
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
        fix = f"set {p}.optimizer.overlap_param_gather=false"
        if not distopt:
            why = (
                "the parameter all-gather it overlaps exists only with "
                f"{p}.optimizer.use_distributed_optimizer=true (megatron-core silently "
                "ignores it otherwise), and even then " + why
            )
        out.append(MegatronProblem("optimizer.overlap_param_gather", True, why, fix, prefix=p))
    return out


def _fp8_problems(
    options: Mapping[str, Any], p: str, te_available: bool | None
) -> list[MegatronProblem]:
    """The FP8 recipe name, the Transformer Engine layer spec that FP8 needs, and FP8
    parameters themselves, which this backend does not support yet (after the more
    specific problems)."""
    out = _fp8_setting_problems(options, p, te_available)
    if bool(options.get("fp8_param", False)):
        why = (
            "FP8 parameters are not supported by the Megatron backend yet: Transformer "
            "Engine's FP8 matmuls refuse a micro-batch whose token count is not a multiple "
            "of 8 (the backend does not pad), TE keeps FP8 weights in tensors whose own "
            "storage is empty (sleep would leave them on the GPU), and the weight export "
            "would hand TE's quantized tensors to the engines and checkpoints"
        )
        fix = f"set {p}.fp8_param=false"
        out.append(MegatronProblem("fp8_param", True, why, fix, prefix=p))
    return out


def _fp8_setting_problems(
    options: Mapping[str, Any], p: str, te_available: bool | None
) -> list[MegatronProblem]:
    """The FP8 recipe name, and the Transformer Engine layer spec that FP8 needs."""
    out: list[MegatronProblem] = []
    fp8, recipe = bool(options.get("fp8_param", False)), options.get("fp8_recipe")
    if recipe is not None and str(recipe).lower() not in FP8_RECIPES:
        why = "unknown FP8 recipe (megatron-core refuses it when it builds the model)"
        fix = f"use one of {', '.join(FP8_RECIPES)} (null: delayed)"
        out.append(MegatronProblem("fp8_recipe", recipe, why, fix, prefix=p))
    elif recipe is not None and not fp8:
        why = f"has no effect while {p}.fp8_param is false"
        fix = f"set {p}.fp8_param=true for FP8 parameters, or remove {p}.fp8_recipe"
        out.append(MegatronProblem("fp8_recipe", recipe, why, fix, "warning", p))
    impl = options.get("transformer_impl", "auto")
    if te_available is None or impl not in TRANSFORMER_IMPLS:
        return out
    if impl == "transformer_engine" and not te_available:
        fix = f"install ppo-trainer[te] on a CUDA machine, or set {p}.transformer_impl=auto (or local)"
        out.append(
            MegatronProblem(
                "transformer_impl", impl, f"the Transformer Engine layer spec {_TE}", fix, prefix=p
            )
        )
    elif fp8 and not (te_available if impl == "auto" else impl == "transformer_engine"):
        why = (
            f"which {_TE}" if impl == "auto" else f"which {p}.transformer_impl={impl} does not use"
        )
        fix = (
            "install ppo-trainer[te] on a CUDA machine (transformer_impl auto or "
            f"transformer_engine), or set {p}.fp8_param=false"
        )
        out.append(
            MegatronProblem(
                "fp8_param",
                True,
                f"FP8 parameters need the Transformer Engine layer spec, {why}",
                fix,
                prefix=p,
            )
        )
    return out


def mesh_problems(
    *,
    world_size: int,
    tp: int,
    pp: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    vocab: int | None = None,
    layers: int | None = None,
    source: str = "the model's config",
    prefix: str = "megatron_cfg",
    world_key: str = "world_size",
) -> list[MegatronProblem]:
    """The parallel mesh: ``tp * pp`` ranks per model replica must divide ``world_size``
    (the rest is data parallel), ``tp`` the heads, key/value heads and vocabulary, ``pp``
    the layers (each count checked when given). ``world_key`` names ``world_size`` in the
    messages (the driver's ``cluster.actor_gpus``)."""
    tp_f, pp_f = "tensor_model_parallel_size", "pipeline_model_parallel_size"
    out = [
        MegatronProblem(
            f,
            v,
            "must be a positive integer",
            f"set {prefix}.{f} to a positive integer",
            prefix=prefix,
        )
        for f, v in ((tp_f, tp), (pp_f, pp))
        if not _is_int(v) or v < 1
    ]
    if out or not _is_int(world_size) or world_size < 1:
        return out
    if world_size % (tp * pp):
        out.append(
            MegatronProblem(
                tp_f if tp > 1 else pp_f,
                tp if tp > 1 else pp,
                f"tensor x pipeline parallel = {tp} x {pp} = {tp * pp} ranks per model "
                f"replica, which does not divide {world_key}={world_size} (one rank per "
                f"device; data parallel = {world_key} / (tensor x pipeline))",
                f"choose {prefix}.{tp_f} and {pp_f} whose product divides {world_size}, or "
                f"set {world_key} to a multiple of {tp * pp}",
                prefix=prefix,
            )
        )
    counts = (("attention heads", heads), ("key/value heads", kv_heads), ("vocabulary size", vocab))
    bad = [f"{what} ({n})" for what, n in counts if n is not None and n % tp]
    if bad:
        common = math.gcd(*(n for _, n in counts if n is not None))
        out.append(
            MegatronProblem(
                tp_f,
                tp,
                f"must divide the model's {' and '.join(bad)} (from {source})",
                f"set {prefix}.{tp_f} to a common divisor of them (their greatest is {common})",
                prefix=prefix,
            )
        )
    if layers is not None and layers % pp:
        out.append(
            MegatronProblem(
                pp_f,
                pp,
                f"must divide the model's {layers} layers (from {source})",
                f"set {prefix}.{pp_f} to a divisor of {layers}",
                prefix=prefix,
            )
        )
    return out


def data_parallel_size(
    *,
    world_size: int,
    tp: int,
    pp: int,
    prefix: str = "megatron_cfg",
    world_key: str = "world_size",
) -> int:
    """``world_size / (tp * pp)``; :class:`MegatronConfigError` when the mesh is refused."""
    problems = mesh_problems(
        world_size=world_size, tp=tp, pp=pp, prefix=prefix, world_key=world_key
    )
    if problems:
        raise MegatronConfigError(problems)
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: use a positive integer")
    return world_size // (tp * pp)
