"""Configuration dataclasses of the trainer: the model spec and the actor / critic configs.

Each config's rules are written once, as data: the classmethod ``problems(**values)``
returns every refused field (:class:`TrainerProblem`: field, value, message, fix) without
building anything, and the constructor raises :class:`TrainerConfigError` (a
``ValueError``) carrying that list. Configs are plain, frozen dataclasses so the driver
can build them from YAML and ship them to Ray workers unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LR_SCHEDULERS",
    "OFFLOAD_BACKENDS",
    "ActorConfig",
    "CriticConfig",
    "ModelSpec",
    "TrainerConfigError",
    "TrainerProblem",
    "offload_backend_name",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token", "sample")
LR_SCHEDULERS = ("constant", "linear", "cosine")
OFFLOAD_BACKENDS = ("auto", "host_copy", "memory_saver", "none")
# Accepted and normalised to their OFFLOAD_BACKENDS spelling (ppo_lifecycle's name).
_OFFLOAD_ALIASES = {"torch_memory_saver": "memory_saver"}
_DTYPES = ("float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")


def offload_backend_name(name: str) -> str:
    """The :data:`OFFLOAD_BACKENDS` name a config's ``offload_backend`` is read as: its
    own, or the one an accepted alias stands for (``torch_memory_saver``:
    ``memory_saver``)."""
    return _OFFLOAD_ALIASES.get(name, name)


KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token", "sample"]
LRScheduler = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class TrainerProblem:
    """One refused field of a trainer config: ``field`` is the dataclass field's name,
    ``section`` the config it belongs to (``model``, ``actor``, ``critic``)."""

    field: str
    value: object
    message: str
    fix: str
    section: str = "model"

    def __str__(self) -> str:
        return f"{self.section}.{self.field}={self.value!r} is invalid: {self.message}; {self.fix}"


class TrainerConfigError(ValueError):
    """A trainer config refused, with EVERY problem in ``problems``."""

    def __init__(self, problems: list[TrainerProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def _values(cls: type[Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` over the defaults of ``cls``'s fields (``TypeError`` for an unknown name)."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in values:
            out[f.name] = values[f.name]
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not MISSING:
            out[f.name] = f.default
    unknown = sorted(set(values) - set(out))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r}")
    return out


def _raise_problems(obj: Any) -> None:
    problems = type(obj).problems(**{f.name: getattr(obj, f.name) for f in fields(obj)})
    if problems:
        raise TrainerConfigError(problems)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model both the trainer and the rollout engine build.

    Either ``path`` names a local Hugging Face checkpoint directory (``config.json`` plus
    ``*.safetensors``; never a pickle), or the remaining fields describe a tiny Qwen2
    model that is initialised with random weights drawn from ``seed``. The same spec and
    seed always give the same weights, so the policy, its reference model and the
    rollout engine agree without exchanging files.
    """

    path: str | None = None
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    seed: int = 0
    dtype: str = "float32"

    _SIZES: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    )

    def __post_init__(self) -> None:
        _raise_problems(self)

    @classmethod
    def problems(cls, **values: Any) -> list[TrainerProblem]:
        """Every problem of these field values (the others at their defaults), at once."""
        v = _values(cls, values)
        out = [
            TrainerProblem(name, v[name], "must be a positive integer", "use a positive integer")
            for name in cls._SIZES
            if not _is_int(v[name]) or v[name] <= 0
        ]
        bad = {p.field for p in out}
        heads, kv = v["num_attention_heads"], v["num_key_value_heads"]
        if not bad & {"hidden_size", "num_attention_heads"} and v["hidden_size"] % heads:
            out.append(
                TrainerProblem(
                    "hidden_size",
                    v["hidden_size"],
                    f"must be divisible by model.num_attention_heads={heads}",
                    "use a multiple of the head count",
                )
            )
        if not bad & {"num_key_value_heads", "num_attention_heads"} and heads % kv:
            out.append(
                TrainerProblem(
                    "num_key_value_heads",
                    kv,
                    f"must divide model.num_attention_heads={heads}",
                    "use a divisor of the head count",
                )
            )
        if v["dtype"] not in _DTYPES:
            out.append(
                TrainerProblem("dtype", v["dtype"], "unknown dtype", f"use one of {_DTYPES}")
            )
        return out

    def hf_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.Qwen2Config`` (ignored when ``path`` is set)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


@dataclass(frozen=True, kw_only=True)
class _TrainConfig:
    """Fields the actor and the critic share (optimizer, schedule, batching, placement).

    ``offload_backend``: how ``sleep`` moves the model's memory off its device:
    ``host_copy`` (a copy in host memory; every device), ``memory_saver`` (pauses
    ``torch_memory_saver`` regions; CUDA with that package, torch backend only) or
    ``auto`` (``memory_saver`` where it can run, ``host_copy`` otherwise; see
    :func:`ppo_trainer.resolve_offload_backend`, which the backends call on the worker's
    device). ``torch_memory_saver`` (``ppo_lifecycle``'s name) is read as ``memory_saver``.
    ``none`` turns offload off, for debugging it: ``sleep`` / ``wake_up`` keep their
    bookkeeping (what the worker counts as asleep) but move nothing and keep the process
    groups, so both models and their optimizer states stay on the device at once.
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    backend: str = "torch"
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0
    micro_batch_size: int = 8
    loss_agg: str = "token"
    offload_backend: str = "auto"

    _SECTION: ClassVar[str] = "train"

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload_backend", offload_backend_name(self.offload_backend))
        _raise_problems(self)

    @classmethod
    def problems(cls, **values: Any) -> list[TrainerProblem]:
        """Every problem of these field values (the others at their defaults), at once;
        ``model`` is a built :class:`ModelSpec` (its own :meth:`ModelSpec.problems`)."""
        v = _values(cls, values)
        v["offload_backend"] = offload_backend_name(v["offload_backend"])
        out = [
            TrainerProblem(name, v[name], why, fix, cls._SECTION)
            for name, why, fix in (*_train_rules(v), *cls._own_rules(v))
        ]
        return out

    @classmethod
    def _own_rules(cls, v: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        return []

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view (used in checkpoint metadata)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModelSpec):
                value = {g.name: getattr(value, g.name) for g in fields(value)}
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def _train_rules(v: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(field, why, fix)`` of each refused field the actor and the critic share."""
    out: list[tuple[str, str, str]] = []

    def need(name: str, ok: bool, why: str, fix: str) -> None:
        if not ok:
            out.append((name, why, fix))

    backend, lr, betas = v["backend"], v["lr"], v["betas"]
    need("backend", isinstance(backend, str) and bool(backend), "unknown backend",
         "use 'torch' or 'megatron'")  # fmt: skip
    need("device", v["device"] in _DEVICES, "unknown device", f"use one of {_DEVICES}")
    need("lr", _is_number(lr) and lr > 0, "must be positive and finite",
         "use a positive finite learning rate")  # fmt: skip
    need("weight_decay", _is_number(v["weight_decay"]) and v["weight_decay"] >= 0,
         "must be >= 0", "use a value >= 0")  # fmt: skip
    ok_betas = isinstance(betas, tuple | list) and len(betas) == 2
    need("betas", ok_betas and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas),
         "must be two values in [0, 1)", "use two values in [0, 1), e.g. (0.9, 0.999)")  # fmt: skip
    need("adam_eps", _is_number(v["adam_eps"]) and v["adam_eps"] > 0, "must be positive",
         "use a positive epsilon, e.g. 1e-8")  # fmt: skip
    norm = v["max_grad_norm"]
    need("max_grad_norm", norm is None or (_is_number(norm) and norm > 0), "must be positive",
         "use a positive norm, or null to disable")  # fmt: skip
    sched, decay = v["lr_scheduler"], v["decay_steps"]
    need("lr_scheduler", sched in LR_SCHEDULERS, "unknown scheduler", f"use one of {LR_SCHEDULERS}")
    need("warmup_steps", _is_int(v["warmup_steps"]) and v["warmup_steps"] >= 0,
         "must be an integer >= 0", "use an integer >= 0")  # fmt: skip
    need("decay_steps", sched == "constant" or (_is_int(decay) and decay > 0),
         f"lr_scheduler={sched!r} needs the number of optimizer steps to decay over",
         "use a positive integer")  # fmt: skip
    ratio = v["min_lr_ratio"]
    need("min_lr_ratio", _is_number(ratio) and 0.0 <= ratio <= 1.0, "must be in [0, 1]",
         "use a value in [0, 1]")  # fmt: skip
    mbs = v["micro_batch_size"]
    need("micro_batch_size", _is_int(mbs) and mbs > 0, "must be positive",
         "use a positive integer")  # fmt: skip
    need("loss_agg", v["loss_agg"] in LOSS_AGGREGATIONS, "unknown aggregation",
         f"use one of {LOSS_AGGREGATIONS}")  # fmt: skip
    need("offload_backend", v["offload_backend"] in OFFLOAD_BACKENDS, "unknown offload backend",
         f"use one of {OFFLOAD_BACKENDS} (memory_saver: CUDA and torch_memory_saver only)")  # fmt: skip
    return out


@dataclass(frozen=True, kw_only=True)
class ActorConfig(_TrainConfig):
    """The policy worker.

    ``eps_clip`` / ``eps_clip_high``: the ratio is clipped to
    ``[1 - eps_clip, 1 + eps_clip_high]`` (``eps_clip_high=None`` means symmetric).
    ``dual_clip``: a constant ``c > 1`` bounding the loss of negative-advantage tokens by
    ``-c * A`` (``None`` disables it). ``kl_loss_coef > 0`` builds a frozen reference
    model and adds ``kl_loss_coef * KL`` (estimator ``kl_estimator``) to the loss.
    ``entropy_coef`` subtracts ``entropy_coef * entropy``.
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    _SECTION: ClassVar[str] = "actor"

    @classmethod
    def _own_rules(cls, v: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        out: list[tuple[str, str, str]] = []
        eps, high, dual = v["eps_clip"], v["eps_clip_high"], v["dual_clip"]
        if not (_is_number(eps) and 0.0 < eps < 1.0):
            out.append(("eps_clip", "must be in (0, 1)", "use a value in (0, 1), e.g. 0.2"))
        if high is not None and not (_is_number(high) and high > 0):
            out.append(
                ("eps_clip_high", "must be positive", "use a positive value or null (= eps_clip)")
            )
        if dual is not None and not (_is_number(dual) and dual > 1.0):
            out.append(("dual_clip", "must be > 1", "use a constant > 1 (e.g. 3.0) or null"))
        for name in ("kl_loss_coef", "entropy_coef"):
            if not (_is_number(v[name]) and v[name] >= 0):
                out.append((name, "must be >= 0", "use a value >= 0"))
        if v["kl_estimator"] not in KL_ESTIMATORS:
            out.append(("kl_estimator", "unknown estimator", f"use one of {KL_ESTIMATORS}"))
        return out

    @property
    def use_reference(self) -> bool:
        """Whether a frozen reference model is built (only for the KL loss)."""
        return self.kl_loss_coef > 0.0


@dataclass(frozen=True, kw_only=True)
class CriticConfig(_TrainConfig):
    """The value worker. ``value_clip``: clip new values to ``old_values ± value_clip``
    in the clipped value loss (``None`` disables clipping)."""

    value_clip: float | None = 0.2

    _SECTION: ClassVar[str] = "critic"

    @classmethod
    def _own_rules(cls, v: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        clip = v["value_clip"]
        if clip is not None and not (_is_number(clip) and clip > 0):
            return [("value_clip", "must be positive", "use a positive value or null")]
        return []
