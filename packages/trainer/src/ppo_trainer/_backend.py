"""The backend contract: what a training backend must implement for the workers.

The workers (``ActorWorker``, ``CriticWorker``) own the PPO logic: losses, chunk and step
accounting, the loss denominator, checkpoint files, idempotent sleep/wake_up. A backend
owns everything that depends on how the model is stored and parallelised: building the
models, running micro-batches forward/backward, the data-parallel gradient reduction,
the optimizer and scheduler, weight conversion to Hugging Face names, and moving its
own memory on sleep/wake_up. Two backends exist: ``torch`` (``_torch_backend.py``, the
CPU default) and ``megatron`` (``ppo_trainer/megatron``, optional extra).

A backend is a module (or object) registered under a name with ``register_backend(name,
"module.path:factory")`` and reached with ``get_backend(name)``. The factory is called
once per worker and rank::

    factory(*, config: ActorConfig | CriticConfig, rank: int, world_size: int,
            dist_init_method: str | None) -> Backend

A ``Backend`` (one per worker per rank) must provide:

* ``name``, ``device`` (where the worker puts batches), ``mesh`` (a :class:`Mesh`: this
  rank's place in the group). ``world_size`` counts every rank of the worker group; the
  data-parallel size is ``world_size / (tensor * pipeline parallel)``. The driver shards
  batches over data-parallel ranks; ranks of one model-parallel group receive the same
  shard.
  The factory initialises ``torch.distributed`` from ``dist_init_method`` when
  ``world_size > 1`` (gloo on CPU, NCCL on CUDA), or reuses an already initialised
  default group of the same size (an actor and a critic in one process share it).
* ``build_policy() -> TrainModel``: the causal LM, trainable, with its optimizer
  (AdamW: ``lr``, ``betas``, ``adam_eps``, ``weight_decay``) and scheduler
  (``lr_multiplier`` below, stepped once per optimizer step).
* ``build_reference() -> FrozenModel``: the same causal LM with the initial weights,
  no gradients, never updated.
* ``build_critic() -> TrainModel``: the same architecture with a scalar value head.
* ``all_reduce_sum(values) -> list[float]``: sum plain floats over the data-parallel
  group (valid-token counts, metrics). Identity when ``dp_size == 1``.
* ``release_process_groups()`` / ``restore_process_groups()``: called by the workers'
  first ``sleep`` (resident -> asleep) and by every ``wake_up`` (also one on a resident
  worker: a retry may follow a failure between the two). Release hands back the device
  memory the backend's communicators hold and restore brings it back before anything
  communicates; both are idempotent and collective (every rank of the worker group
  calls them, in the same order). With NCCL both backends suspend their communicators'
  buffers (``ProcessGroupNCCL.suspend()`` / ``resume()``, i.e. ``ncclCommSuspend`` /
  ``ncclCommResume``, NCCL >= 2.29.7): the group objects stay valid, so nothing that
  holds them (megatron's DDP, Transformer Engine) needs rebuilding; with an older NCCL
  they stay resident (logged once). The torch backend's only group is the default one
  (data parallel); megatron's are every group of the process. Several models in one
  process share groups, so they are suspended only while all of them sleep
  (:class:`ppo_trainer.CommunicatorSuspender`). Gloo (CPU) holds no device memory (TCP
  sockets and small host buffers): nothing is released there.

A ``FrozenModel`` must provide:

* ``forward(micro_batches, *, fn) -> list[Tensor]``: for every micro-batch (a dict with
  at least ``input_ids`` and ``attention_mask``, ``[b, T]``, on ``device``) run the
  model without gradients and return ``fn(output, micro_batch)`` (detached). ``output``
  is, in the model's NATIVE (unshifted) layout, as float32:
  - causal LM: logits ``[b, T, V]`` over the FULL vocabulary (a backend with
    vocab-parallel shards gathers them first), ``logits[:, t]`` scores token ``t + 1``;
  - critic: values ``[b, T]``, ``values[:, t]`` read from the hidden state at ``t``.
  The worker's ``fn`` turns that into the shifted layout of docs/interfaces.md. With
  pipeline parallelism, ``fn`` runs on the last stage and the backend broadcasts its
  ``[b, T]`` result so every rank returns it.
* ``export_hf() -> dict[str, Tensor]``: the full weights under Hugging Face
  ``state_dict()`` names, contiguous CPU tensors, the same on every rank that calls it.
  A collective over the model-parallel (tensor x pipeline) group at most: every rank of
  that group calls it; ranks of other data-parallel shards need not (the actor's
  ``export_weights`` calls it on the group of global rank 0 only).
* ``load_hf(state)``: the inverse (strict: every name present, same shapes).
* ``sleep(parts=...)`` / ``wake_up(parts=...)``: move this model's memory off / back to the
  device (both backends use ``ppo_lifecycle.OffloadManager``). ``parts`` is a set of
  ``Part`` (``PARAMETERS``, ``OPTIMIZER``, ``GRADIENTS``, ``BUFFERS``); parts not
  named stay resident (the actor keeps ``GRADIENTS`` between chunks). ``sleep`` may
  be called again with further, disjoint parts before ``wake_up``; ``wake_up`` brings
  back the sleeping ones of ``parts`` (default: everything; a forward needs only
  ``FORWARD_PARTS``) and may be called again for the rest. The worker passes every
  part it wants asleep (or awake); parts already there are skipped by
  ``OffloadManager`` (a storage shared by two parts wakes with either). After
  ``wake_up`` every tensor holds exactly its old value and the accumulated gradients are untouched by a keep-gradients sleep.
  Honour ``config.offload_backend`` (``auto`` / ``host_copy`` / ``memory_saver``) as
  :func:`ppo_trainer.resolve_offload_backend` resolves it on the backend's device
  (``auto``: ``memory_saver`` on CUDA with torch_memory_saver installed where the backend
  supports it, ``host_copy`` otherwise). The megatron backend supports ``host_copy``
  only (megatron-core allocates its DDP buffers outside any memory-saver region): it
  refuses ``memory_saver`` and reads ``auto`` as ``host_copy``. Either way sleep must
  leave the memory usable by ANOTHER process (the host copy empties the CUDA caching
  allocator; the memory saver unmaps its region).

A ``TrainModel`` is a ``FrozenModel`` plus:

* ``forward_backward(micro_batches, *, loss_fn) -> list[dict[str, float]]``: for each
  micro-batch run the forward WITH gradients, ``loss, metrics = loss_fn(output,
  micro_batch)`` and accumulate ``d loss / d params`` into the gradients (no reduction
  over ranks, no scaling: the worker has already divided by the step's denominator).
* ``grads() -> dict[str, Tensor]``: the accumulated local (or, after
  ``all_reduce_grads``, reduced) gradients by parameter name (backend-native names are
  fine), zeros for parameters without a gradient yet. Used by tests and diagnostics.
* ``all_reduce_grads()``: SUM the gradients over the data-parallel group (no averaging).
* ``scale_grads(factor)``: multiply the accumulated local gradients by ``factor``
  (streaming with a token denominator known only after the last chunk).
* ``grad_norm() -> float``: the 2-norm of this rank's (reduced) gradients, read in
  place (no copy); under tensor/pipeline parallelism, of this rank's shard. The workers
  check it is finite before ``step()``.
* ``step() -> dict[str, float]``: clip the global gradient norm to ``max_grad_norm``
  (when set), one optimizer step, one scheduler step; returns at least ``grad_norm``
  (before clipping) and ``lr`` (the rate used). Does not zero the gradients.
* ``zero_grad()``: reset the accumulated gradients to zero (or None).
* ``checkpoint_state() -> dict[str, Any]`` / ``load_checkpoint_state(state)``: this
  rank's model, optimizer and scheduler state as a nested structure of dicts, lists,
  tuples, tensors and JSON scalars (keys ``"model"``, ``"optimizer"``, ``"scheduler"``).
  The worker writes the tensors to safetensors and the rest to JSON; nothing is pickled.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from ppo_lifecycle import Part

if TYPE_CHECKING:
    from ppo_trainer._config import ActorConfig, CriticConfig

__all__ = [
    "Backend",
    "BackendFactory",
    "Batch",
    "FrozenModel",
    "Mesh",
    "TrainModel",
    "available_backends",
    "backend_importable",
    "get_backend",
    "lr_multiplier",
    "register_backend",
]

Batch = Mapping[str, torch.Tensor]
"""One micro-batch: ``input_ids`` / ``attention_mask`` (``[b, T]``) plus worker tensors."""

ForwardFn = Callable[[torch.Tensor, Batch], torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class Mesh:
    """Where one rank of a worker group sits in its parallel layout (``worker.mesh()``).

    ``rank`` / ``world_size``: the rank in the worker group and the group's size (every
    rank, all parallel dimensions). ``dp_rank`` / ``dp_size``: its data-parallel shard and
    the number of shards; ``tp_rank`` / ``tp_size`` and ``pp_rank`` / ``pp_size``: its
    place in the tensor- and pipeline-parallel groups (``world_size == dp_size * tp_size
    * pp_size``). The torch backend is data parallel only (``dp_rank == rank``, ``tp_size
    == pp_size == 1``); the megatron backend reads megatron's ``parallel_state``.

    How the driver uses it: split a batch's rows over the ``dp_size`` shards only, give
    every rank with the same ``dp_rank`` (its tensor/pipeline peers) the same rows, and
    take each result from one rank per ``dp_rank`` (they all return the same). Calls that
    are collectives (everything that runs the model, ``export_weights``) go to every rank.
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_size: int
    pp_size: int
    _: KW_ONLY
    tp_rank: int
    pp_rank: int

    def __post_init__(self) -> None:
        if self.dp_size * self.tp_size * self.pp_size != self.world_size:
            raise ValueError(
                f"Mesh: dp_size={self.dp_size} x tp_size={self.tp_size} x pp_size="
                f"{self.pp_size} != world_size={self.world_size}"
            )
        for name, index, size in (
            ("rank", self.rank, self.world_size),
            ("dp_rank", self.dp_rank, self.dp_size),
            ("tp_rank", self.tp_rank, self.tp_size),
            ("pp_rank", self.pp_rank, self.pp_size),
        ):
            if not 0 <= index < size:
                raise ValueError(f"Mesh: {name}={index} is out of range for size {size}")


@runtime_checkable
class FrozenModel(Protocol):
    """A model that only runs forward (the reference model; base of ``TrainModel``)."""

    def forward(self, micro_batches: Sequence[Batch], *, fn: ForwardFn) -> list[torch.Tensor]: ...

    def export_hf(self) -> dict[str, torch.Tensor]: ...

    def load_hf(self, state: Mapping[str, torch.Tensor]) -> None: ...

    def sleep(self, *, parts: frozenset[Part]) -> None: ...

    def wake_up(self, *, parts: frozenset[Part] = ...) -> None: ...


@runtime_checkable
class TrainModel(FrozenModel, Protocol):
    """A trainable model with its optimizer and scheduler on one rank."""

    def forward_backward(
        self, micro_batches: Sequence[Batch], *, loss_fn: LossFn
    ) -> list[dict[str, float]]: ...

    def grads(self) -> dict[str, torch.Tensor]: ...

    def all_reduce_grads(self) -> None: ...

    def scale_grads(self, factor: float) -> None: ...

    def grad_norm(self) -> float: ...

    def step(self) -> dict[str, float]: ...

    def zero_grad(self) -> None: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """One backend instance per worker and rank (see the module docstring)."""

    name: str
    device: torch.device
    mesh: Mesh

    def build_policy(self) -> TrainModel: ...

    def build_reference(self) -> FrozenModel: ...

    def build_critic(self) -> TrainModel: ...

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]: ...

    def release_process_groups(self) -> None: ...

    def restore_process_groups(self) -> None: ...


class BackendFactory(Protocol):
    def __call__(
        self,
        *,
        config: ActorConfig | CriticConfig,
        rank: int,
        world_size: int,
        dist_init_method: str | None,
    ) -> Backend: ...


# name -> "module:attribute" of the factory; imported lazily so that listing the
# backends never imports an optional extra.
_REGISTRY: dict[str, str] = {
    "torch": "ppo_trainer._torch_backend:create_backend",
    "megatron": "ppo_trainer.megatron:create_backend",
}


def sum_floats_over_ranks(
    values: Sequence[float], *, dp_size: int, device: torch.device, group: Any = None
) -> list[float]:
    """Sum a few Python floats over the data-parallel ranks (float64, one all-reduce)."""
    if dp_size == 1:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [float(v) for v in t.tolist()]


def register_backend(name: str, target: str) -> None:
    """Register (or replace) a backend factory given as ``"module.path:attribute"``."""
    if ":" not in target:
        raise ValueError(f"backend target {target!r} is invalid: use 'module.path:factory'")
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    """The registered backend names (importable or not), in registration order."""
    return list(_REGISTRY)


def get_backend(name: str) -> BackendFactory:
    """The factory registered under ``name``.

    Raises ``ValueError`` for an unknown name and ``ImportError`` (naming the extra to
    install) when the backend's dependencies are missing.
    """
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is unknown: use one of {available_backends()}"
        ) from None
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"backend={name!r} cannot be imported ({exc}); install the extra, e.g. "
            f"`uv sync --extra {name}` / `pip install 'ppo-trainer[{name}]'`"
        ) from exc
    factory: BackendFactory = getattr(module, attr)
    return factory


def backend_importable(name: str) -> bool:
    """Whether ``get_backend(name)`` succeeds (its optional dependencies import)."""
    try:
        get_backend(name)
    except ImportError:
        return False
    return True


def lr_multiplier(
    *,
    step: int,
    scheduler: str,
    warmup_steps: int,
    decay_steps: int | None,
    min_lr_ratio: float,
) -> float:
    """The learning-rate factor applied at optimizer step ``step`` (0-based).

    Linear warm-up from ``1 / (warmup_steps + 1)`` to 1 over ``warmup_steps`` steps, then
    ``constant`` (1), ``linear`` or ``cosine`` decay to ``min_lr_ratio`` over
    ``decay_steps`` steps (counted after warm-up), then flat at ``min_lr_ratio``.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if scheduler == "constant":
        return 1.0
    if decay_steps is None or decay_steps <= 0:
        raise ValueError(f"decay_steps={decay_steps!r} is invalid for lr_scheduler={scheduler!r}")
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if scheduler == "linear":
        decay = 1.0 - progress
    elif scheduler == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler={scheduler!r} is unknown: use constant, linear or cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
