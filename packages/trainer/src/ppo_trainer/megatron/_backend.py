"""The ``megatron`` backend: megatron-core ``GPTModel``, megatron DDP and optimizer.

One :class:`MegatronBackend` per worker and rank. Set-up initialises
``torch.distributed`` (gloo on CPU, NCCL on CUDA; a one-rank group when
``world_size == 1``) and megatron's ``parallel_state`` with the tensor / pipeline sizes
of ``backend_options`` (the data-parallel size is what is left of ``world_size``). An
actor and a critic in one process share that layout.

Models are built in megatron's own layout and filled from the Hugging Face model of the
same ``ModelSpec`` (``build_causal_lm`` / ``build_value_model`` of the torch backend,
converted by :mod:`._convert`), so both backends start from identical weights. The
layer spec is Transformer Engine's when TE imports and CUDA is present, the local
(pure megatron-core) spec otherwise. The critic is the same ``GPTModel`` whose output
layer is replaced by a scalar value head. Without CUDA every megatron call runs inside
:func:`._cpu_shim.cuda_as_cpu`.

Gradients: megatron DDP (classic, optionally with the distributed optimizer)
accumulates into its contiguous ``main_grad`` buffers; the config sets
``calculate_per_token_loss`` so that neither the schedule nor DDP rescales anything:
``all_reduce_grads`` SUMS over the data-parallel group, as the worker contract needs.

The pieces live in their own modules: :mod:`._core` (megatron-core's names, the call
context), :mod:`._parallel` (process groups and the parallel layout), :mod:`._build`
(the ``GPTModel`` and its weights), :mod:`._frozen_model` / :mod:`._train_model` (the
models the workers drive) and :mod:`._checkpoint` (optimizer state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_trainer._backend import Mesh, sum_floats_over_ranks
from ppo_trainer._config import ActorConfig, CriticConfig
from ppo_trainer._offload import (
    CommunicatorSuspender,
    SuspendableComm,
    nccl_communicators,
    process_groups,
    resolve_offload_backend,
)
from ppo_trainer._torch_backend import resolve_device
from ppo_trainer.megatron._build import build_gpt
from ppo_trainer.megatron._core import _megatron_call, ps, transformer_engine_available
from ppo_trainer.megatron._frozen_model import MegatronFrozenModel
from ppo_trainer.megatron._options import MegatronOptions, parse_options
from ppo_trainer.megatron._parallel import _init_distributed, _init_model_parallel
from ppo_trainer.megatron._train_model import MegatronTrainModel

__all__ = [
    "MegatronBackend",
    "MegatronFrozenModel",
    "MegatronTrainModel",
    "create_backend",
    "transformer_engine_available",
]


class MegatronBackend:
    """The ``megatron`` backend on one rank."""

    name = "megatron"

    def __init__(
        self,
        *,
        config: ActorConfig | CriticConfig,
        rank: int,
        world_size: int,
        dist_init_method: str | None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank}, world_size={world_size} are invalid: need 0 <= rank < world_size"
            )
        role = "critic" if isinstance(config, CriticConfig) else "policy"
        self.opts = parse_options(config.backend_options, role=role)
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and torch.cuda.is_available():
            raise ValueError(
                f"{role}.device={config.device!r} is not supported by the megatron backend on a "
                "machine with CUDA (megatron-core places its tensors on the current GPU): use "
                "'auto' or 'cuda'"
            )
        self.use_te = _use_transformer_engine(self.opts)
        # host_copy only (memory_saver refused with the fix; auto is host_copy here): the
        # models below are built with ppo_lifecycle's storage-level host copies.
        self.offload_backend = resolve_offload_backend(
            config.offload_backend,
            device=self.device,
            backend="megatron",
            key=f"{role}.offload_backend",
        )
        seed = self.opts.seed if self.opts.seed is not None else config.model.seed
        with _megatron_call():
            _init_distributed(
                rank=rank,
                world_size=world_size,
                dist_init_method=dist_init_method,
                device=self.device,
            )
            _init_model_parallel(self.opts, world_size=world_size, seed=seed)
        self.mesh = Mesh(
            rank,
            world_size,
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
        )
        self.communicators = CommunicatorSuspender(
            self._communicators, name="critic" if role == "critic" else "actor"
        )

    # -- models -------------------------------------------------------------------------
    def _build_trainable(self, *, critic: bool) -> MegatronTrainModel:
        built = build_gpt(
            self.config.model, self.opts, use_te=self.use_te, device=self.device, critic=critic
        )
        model = MegatronTrainModel(
            built.gpt,
            layout=built.layout,
            device=self.device,
            offset=built.offset,
            config=self.config,
            opts=self.opts,
            tconfig=built.tconfig,
            name="critic" if critic else "actor",
        )
        model.load_hf(built.hf_state)
        return model

    def build_policy(self) -> MegatronTrainModel:
        return self._build_trainable(critic=False)

    def build_reference(self) -> MegatronFrozenModel:
        built = build_gpt(
            self.config.model, self.opts, use_te=self.use_te, device=self.device, critic=False
        )
        built.gpt.requires_grad_(False)
        model = MegatronFrozenModel(
            built.gpt, layout=built.layout, device=self.device, offset=built.offset
        )
        model.load_hf(built.hf_state)
        return model

    def build_critic(self) -> MegatronTrainModel:
        return self._build_trainable(critic=True)

    # -- collectives ----------------------------------------------------------------------
    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return sum_floats_over_ranks(
            values,
            dp_size=self.mesh.dp_size,
            device=self.device,
            group=ps.get_data_parallel_group(),
        )

    @staticmethod
    def _communicators() -> list[SuspendableComm]:
        # Every group of the process (megatron's parallel_state groups and the default
        # one), in creation order: the same on every rank.
        return nccl_communicators(process_groups())

    def release_process_groups(self) -> None:
        """NCCL (CUDA): suspend the device buffers of every NCCL communicator of the
        process (``ncclCommSuspend``; the group objects megatron's DDP, optimizer and
        Transformer Engine layers hold stay valid), once every model of this process is
        asleep: an actor and a critic in one process share megatron's groups
        (:class:`ppo_trainer.CommunicatorSuspender`). Gloo (CPU) holds no device memory:
        nothing to release."""
        self.communicators.release()

    def restore_process_groups(self) -> None:
        """Resume what :meth:`release_process_groups` suspended (idempotent)."""
        self.communicators.restore()


def _use_transformer_engine(opts: MegatronOptions) -> bool:
    """``transformer_impl``: ``auto`` uses Transformer Engine when it is usable;
    ``transformer_engine`` without it is refused with the fix."""
    impl = opts.transformer_impl
    te_ok = transformer_engine_available()
    if impl == "transformer_engine" and not te_ok:
        raise ValueError(
            f"{opts.prefix}.transformer_impl='transformer_engine' needs CUDA and the "
            f"`te` extra: install it or set {opts.prefix}.transformer_impl='local'"
        )
    return te_ok if impl == "auto" else impl == "transformer_engine"


def create_backend(
    *,
    config: ActorConfig | CriticConfig,
    rank: int,
    world_size: int,
    dist_init_method: str | None,
) -> MegatronBackend:
    """Registry factory of the ``megatron`` backend (``get_backend("megatron")``)."""
    return MegatronBackend(
        config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
    )
