"""Process groups of the megatron backend: ``torch.distributed`` (gloo on CPU, NCCL on
CUDA; a one-rank group when ``world_size == 1``) and megatron's ``parallel_state`` with
the tensor / pipeline sizes of ``backend_options`` (the data-parallel size is what is
left of ``world_size``). An actor and a critic in one process share that layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ppo_trainer._megatron_rules import data_parallel_size
from ppo_trainer._torch_backend import group_already_initialised, tcp_rendezvous_store
from ppo_trainer.megatron._core import model_parallel_cuda_manual_seed, ps
from ppo_trainer.megatron._options import MegatronOptions

__all__ = ["_init_distributed", "_init_model_parallel"]


def _init_distributed(
    *, rank: int, world_size: int, dist_init_method: str | None, device: torch.device
) -> None:
    if group_already_initialised(rank=rank, world_size=world_size):
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size == 1 and dist_init_method is None:
        # megatron needs a process group even alone: a one-rank group on an in-memory store.
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
        return
    if dist_init_method is None:
        raise ValueError(
            f"dist_init_method=None is invalid with world_size={world_size}: pass a "
            "rendezvous address such as 'tcp://10.0.0.1:29500' or 'file:///tmp/pg'"
        )
    tcp_store = tcp_rendezvous_store(dist_init_method, rank=rank, world_size=world_size)
    dist.init_process_group(  # a tcp:// rendezvous listens on its host only
        backend=backend,
        init_method=None if tcp_store is not None else dist_init_method,
        store=tcp_store,
        rank=rank,
        world_size=world_size,
    )


def _init_model_parallel(opts: MegatronOptions, *, world_size: int, seed: int) -> None:
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    data_parallel_size(world_size=world_size, tp=tp, pp=pp, prefix=opts.prefix)
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp):
            raise ValueError(
                f"{opts.prefix}.tensor_model_parallel_size={tp}, pipeline_model_parallel_size="
                f"{pp} differ from the layout already initialised in this process {have}: the "
                "actor and the critic share ranks, so give them the same parallel sizes"
            )
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
