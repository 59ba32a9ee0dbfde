"""Configuration dataclasses of the trainer: the model spec and the actor / critic configs.

Every check raises ``ValueError`` naming the key, the bad value and the fix. Configs are
plain, frozen dataclasses so the driver can build them from YAML and ship them to Ray
workers unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LR_SCHEDULERS",
    "OFFLOAD_BACKENDS",
    "ActorConfig",
    "CriticConfig",
    "ModelSpec",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token", "sample")
LR_SCHEDULERS = ("constant", "linear", "cosine")
OFFLOAD_BACKENDS = ("auto", "host_copy", "memory_saver", "none")
# Accepted and normalised to their OFFLOAD_BACKENDS spelling (ppo_lifecycle's name).
_OFFLOAD_ALIASES = {"torch_memory_saver": "memory_saver"}
_DTYPES = ("float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")

KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token", "sample"]
LRScheduler = Literal["constant", "linear", "cosine"]


def _bad(key: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{key}={value!r} is invalid: {fix}")


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

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise _bad(f"model.{name}", value, "use a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise _bad(
                "model.hidden_size",
                self.hidden_size,
                f"must be divisible by model.num_attention_heads={self.num_attention_heads}",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise _bad(
                "model.num_key_value_heads",
                self.num_key_value_heads,
                f"must divide model.num_attention_heads={self.num_attention_heads}",
            )
        if self.dtype not in _DTYPES:
            raise _bad("model.dtype", self.dtype, f"use one of {_DTYPES}")

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

    def __post_init__(self) -> None:
        p = self._prefix()
        if not isinstance(self.backend, str) or not self.backend:
            raise _bad(f"{p}.backend", self.backend, "use 'torch' or 'megatron'")
        if self.device not in _DEVICES:
            raise _bad(f"{p}.device", self.device, f"use one of {_DEVICES}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise _bad(f"{p}.lr", self.lr, "use a positive finite learning rate")
        if self.weight_decay < 0:
            raise _bad(f"{p}.weight_decay", self.weight_decay, "use a value >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise _bad(f"{p}.betas", self.betas, "use two values in [0, 1), e.g. (0.9, 0.999)")
        if self.adam_eps <= 0:
            raise _bad(f"{p}.adam_eps", self.adam_eps, "use a positive epsilon, e.g. 1e-8")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise _bad(
                f"{p}.max_grad_norm", self.max_grad_norm, "use a positive norm, or null to disable"
            )
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise _bad(f"{p}.lr_scheduler", self.lr_scheduler, f"use one of {LR_SCHEDULERS}")
        if self.warmup_steps < 0:
            raise _bad(f"{p}.warmup_steps", self.warmup_steps, "use an integer >= 0")
        if self.lr_scheduler != "constant" and (self.decay_steps is None or self.decay_steps <= 0):
            raise _bad(
                f"{p}.decay_steps",
                self.decay_steps,
                f"lr_scheduler={self.lr_scheduler!r} needs the number of optimizer steps "
                "to decay over (a positive integer)",
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise _bad(f"{p}.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        if self.micro_batch_size <= 0:
            raise _bad(f"{p}.micro_batch_size", self.micro_batch_size, "use a positive integer")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise _bad(f"{p}.loss_agg", self.loss_agg, f"use one of {LOSS_AGGREGATIONS}")
        if self.offload_backend in _OFFLOAD_ALIASES:
            object.__setattr__(self, "offload_backend", _OFFLOAD_ALIASES[self.offload_backend])
        if self.offload_backend not in OFFLOAD_BACKENDS:
            raise _bad(
                f"{p}.offload_backend",
                self.offload_backend,
                f"use one of {OFFLOAD_BACKENDS} (memory_saver: CUDA and torch_memory_saver only)",
            )

    def _prefix(self) -> str:
        return "train"

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

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.eps_clip < 1.0:
            raise _bad("actor.eps_clip", self.eps_clip, "use a value in (0, 1), e.g. 0.2")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise _bad(
                "actor.eps_clip_high",
                self.eps_clip_high,
                "use a positive value or null (= eps_clip)",
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise _bad("actor.dual_clip", self.dual_clip, "use a constant > 1 (e.g. 3.0) or null")
        if self.kl_loss_coef < 0:
            raise _bad("actor.kl_loss_coef", self.kl_loss_coef, "use a value >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise _bad("actor.kl_estimator", self.kl_estimator, f"use one of {KL_ESTIMATORS}")
        if self.entropy_coef < 0:
            raise _bad("actor.entropy_coef", self.entropy_coef, "use a value >= 0")

    def _prefix(self) -> str:
        return "actor"

    @property
    def use_reference(self) -> bool:
        """Whether a frozen reference model is built (only for the KL loss)."""
        return self.kl_loss_coef > 0.0


@dataclass(frozen=True, kw_only=True)
class CriticConfig(_TrainConfig):
    """The value worker. ``value_clip``: clip new values to ``old_values ± value_clip``
    in the clipped value loss (``None`` disables clipping)."""

    value_clip: float | None = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.value_clip is not None and self.value_clip <= 0:
            raise _bad("critic.value_clip", self.value_clip, "use a positive value or null")

    def _prefix(self) -> str:
        return "critic"
