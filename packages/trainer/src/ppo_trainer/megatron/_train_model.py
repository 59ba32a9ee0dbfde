"""A megatron ``GPTModel`` that trains: megatron DDP and a megatron optimizer (Adam).

Gradients: megatron DDP (classic, optionally with the distributed optimizer)
accumulates into its contiguous ``main_grad`` buffers; the config sets
``calculate_per_token_loss`` so that neither the schedule nor DDP rescales anything:
``all_reduce_grads`` SUMS over the data-parallel group, as the worker contract needs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from ppo_lifecycle import OffloadManager, Part
from torch import nn

from ppo_trainer._backend import Batch, LossFn, lr_multiplier
from ppo_trainer._config import ActorConfig, CriticConfig
from ppo_trainer.megatron import _convert
from ppo_trainer.megatron._checkpoint import (
    load_main_params,
    load_optimizer_state,
    optimizer_state,
)
from ppo_trainer.megatron._core import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    _megatron_call,
    finalize_model_grads,
    get_megatron_optimizer,
    ps,
)
from ppo_trainer.megatron._frozen_model import MegatronFrozenModel
from ppo_trainer.megatron._options import MegatronOptions

__all__ = ["MegatronTrainModel"]

log = logging.getLogger(__name__)


class MegatronTrainModel(MegatronFrozenModel):
    """A ``GPTModel`` wrapped in megatron DDP with a megatron optimizer (Adam)."""

    def __init__(
        self,
        gpt: nn.Module,
        *,
        layout: _convert.Layout,
        device: torch.device,
        offset: int,
        config: ActorConfig | CriticConfig,
        opts: MegatronOptions,
        tconfig: Any,
        name: str,
    ) -> None:
        super().__init__(gpt, layout=layout, device=device, offset=offset, name=name)
        self.config = config
        self.opts = opts
        with _megatron_call():
            self.ddp = DistributedDataParallel(
                config=tconfig, ddp_config=_ddp_config(opts), module=gpt
            )
            self.module = self.ddp
            opt_config = _optimizer_config(config, opts, dtype=tconfig.params_dtype)
            self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
            # megatron exempts biases and norms from weight decay; the torch backend's
            # AdamW decays every parameter. Same rule here, so both backends agree.
            for group in self.optimizer.param_groups:
                group["weight_decay"] = config.weight_decay
            # float16: megatron's optimizer unscales the main gradients by 1/loss_scale
            # in step(), so the loss must be multiplied by it before backward. The
            # pipeline schedules do that through config.grad_scale_func; the PP=1 path
            # calls backward itself (forward_backward).
            self._scalers = [
                scaler
                for opt in self._chained()
                if (scaler := getattr(opt, "grad_scaler", None)) is not None
            ]
            if self._scalers:
                tconfig.grad_scale_func = self.optimizer.scale_loss
        self._steps = 0
        self._overflow = False  # float16: this step's scaled gradients overflowed
        self._main_params = _own_tensors(self._inner_optimizers(), model=gpt)
        # Parameters live in DDP's param buffer, gradients in its separate grad buffer
        # (``main_grad`` views), Adam's moments in the inner torch optimizers' state, the
        # fp32 main parameters (mixed precision) in the optimizer's own tensors.
        self.lifecycle = OffloadManager(
            gpt,
            None,
            device=device,
            backend="host_copy",
            name=name,
            keep_gradients=True,
            extra={Part.OPTIMIZER: self._optimizer_state},
        )

    def _chained(self) -> list[Any]:
        """Megatron's optimizers (one per param-group set) inside the ChainedOptimizer."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt.optimizer for opt in self._chained()]

    def _loss_scale(self) -> float:
        """float16's current loss scale (1.0 without a loss scaler)."""
        return float(self.optimizer.get_loss_scale()) if self._scalers else 1.0

    def forward_backward(
        self, micro_batches: Sequence[Batch], *, loss_fn: LossFn
    ) -> list[dict[str, float]]:
        with _megatron_call():
            self.module.train()
            if ps.get_pipeline_model_parallel_world_size() == 1:
                metrics: list[dict[str, float]] = []
                for mb in micro_batches:
                    loss, m = loss_fn(self._output(self._module_forward(mb)), mb)
                    if self._scalers:  # float16 (the schedules use grad_scale_func)
                        loss = self.optimizer.scale_loss(loss)
                    loss.backward()  # type: ignore[no-untyped-call]
                    metrics.append(m)
                return metrics
            payloads = self._run(micro_batches, last_stage_fn=loss_fn, forward_only=False)
            return self._broadcast_metrics(payloads)

    def _broadcast_metrics(self, payloads: list[Any]) -> list[dict[str, float]]:
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        box = [payloads]
        dist.broadcast_object_list(box, src=src, group=group)
        return [dict(m) for m in box[0]]

    def grads(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self._named_params():
            g = getattr(p, "main_grad", None)
            out[name] = g.detach().clone() if g is not None else torch.zeros_like(p)
        return out

    def all_reduce_grads(self) -> None:
        with _megatron_call():
            finalize_model_grads([self.ddp])
            if self._scalers:
                self._check_overflow()

    def _check_overflow(self) -> None:
        """float16: whether the loss-scaled gradients overflowed on any rank.

        Megatron's step() would find it, skip the update and halve the loss scale. The
        worker, however, refuses a non-finite gradient norm BEFORE the step (raising
        ``FloatingPointError``, gradients discarded), so the step is never reached and the
        scale would never come down: the back-off happens here, where the step's gradients
        are complete, and :meth:`grad_norm` then reports the overflow as ``inf`` so that
        every rank refuses the step alike (the flag is reduced over all ranks).
        """
        finite = [torch.isfinite(g).all() for g in self._main_grads()]
        ok = torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool)
        bad = (~ok).to(device=self.device, dtype=torch.float32)  # one sync, not one per tensor
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bool(bad):
            before = self._loss_scale()
            for scaler in self._scalers:
                scaler.update(True)
            self._overflow = True
            log.warning(
                "float16 loss scale %g overflowed the gradients; no update is made this "
                "step and the scale is now %g",
                before,
                self._loss_scale(),
            )

    def _main_grads(self) -> list[torch.Tensor]:
        """This rank's DDP gradient buffers (``main_grad`` views), in parameter order."""
        return [
            g for _, p in self._named_params() if (g := getattr(p, "main_grad", None)) is not None
        ]

    def scale_grads(self, factor: float) -> None:
        # Rescales the local, not yet reduced main_grad buffers in place (megatron DDP's own
        # grad-buffer scaling), so a denominator known only at finish_step stays exact.
        with _megatron_call():
            self.ddp.scale_gradients(factor)

    def grad_norm(self) -> float:
        # This rank's DDP gradient buffers (main_grad), read in place. Not the optimizer's
        # get_grad_norm(): with the distributed optimizer its main gradients exist only
        # inside step(). Under tensor/pipeline parallelism this is the rank's own shard.
        # float16: the buffers hold loss-scaled gradients; the norm reported is the true
        # one (an overflow found by all_reduce_grads reads as inf: the step is refused).
        if self._overflow:
            return float("inf")
        norms = [torch.linalg.vector_norm(g) for g in self._main_grads()]
        if not norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(norms))) / self._loss_scale()

    def step(self) -> dict[str, float]:
        lr = self.config.lr * lr_multiplier(
            step=self._steps,
            scheduler=self.config.lr_scheduler,
            warmup_steps=self.config.warmup_steps,
            decay_steps=self.config.decay_steps,
            min_lr_ratio=self.config.min_lr_ratio,
        )
        scale = self._loss_scale()
        ok = not self._overflow
        if ok:
            with _megatron_call():
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                # (ok, grad_norm of the unscaled main gradients, zeros); ok is False when
                # megatron found inf/nan in them (float16: it also halved the loss scale).
                ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            # A skipped update is not a step: the scheduler does not advance, the
            # gradients are dropped, and the caller learns of it (the same error the
            # worker raises for a non-finite gradient norm).
            self.zero_grad()
            raise FloatingPointError(
                f"the megatron optimizer skipped the update: the gradients are not finite "
                f"(float16 loss scale {scale:g}, now {self._loss_scale():g}); no optimizer "
                "step was taken (gradients discarded)"
            )
        self._steps += 1
        return {"grad_norm": float(grad_norm or 0.0), "lr": lr}

    def zero_grad(self) -> None:
        self._overflow = False
        with _megatron_call():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()

    def _after_load(self) -> None:
        with _megatron_call():
            self.optimizer.reload_model_params()

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        model = {n: p.detach().to("cpu", copy=True) for n, p in self._named_params()}
        optim = optimizer_state(self._chained())
        return {"model": model, "optimizer": optim, "scheduler": {"step": self._steps}}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        model = state["model"]
        with _megatron_call(), torch.no_grad():
            for name, p in self._named_params():
                p.copy_(model[name].to(dtype=p.dtype, device=p.device))
            chained = self._chained()
            inners = [c.optimizer for c in chained]
            load_optimizer_state(chained, state["optimizer"])
            self.optimizer.reload_model_params()
            load_main_params(inners, state["optimizer"])
        self._steps = int(state["scheduler"]["step"])

    # -- sleep / wake_up ------------------------------------------------------------------
    def _optimizer_state(self) -> list[torch.Tensor]:
        state = [
            v
            for inner in self._inner_optimizers()
            for st in inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ]
        return state + self._main_params


def _ddp_config(opts: MegatronOptions) -> Any:
    """Classic megatron DDP, fp32 gradient buffers, nothing overlapped."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=opts.use_distributed_optimizer,
        use_megatron_fsdp=False,
    )


def _optimizer_config(
    config: ActorConfig | CriticConfig, opts: MegatronOptions, *, dtype: torch.dtype
) -> Any:
    """Megatron's Adam with the worker config's hyper-parameters (the learning rate is
    set per step by :meth:`MegatronTrainModel.step`)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.lr * config.min_lr_ratio,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.adam_eps,
        clip_grad=config.max_grad_norm or 0.0,
        use_distributed_optimizer=opts.use_distributed_optimizer,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        # float16 only (a dynamic loss scaler). Megatron starts at 2**32, which
        # overflows float16 gradients at once and backs off by halving over ~17
        # skipped steps; here every overflow aborts the step (see
        # all_reduce_grads), so start where torch.amp's GradScaler starts and
        # halve at the first overflow (no hysteresis).
        initial_loss_scale=2.0**16,
        hysteresis=1,
    )


def _own_tensors(
    inner_optimizers: Sequence[torch.optim.Optimizer], *, model: nn.Module
) -> list[torch.Tensor]:
    """The optimizers' parameters that do not share a storage with ``model``.

    The mixed-precision optimizers' fp32 main parameters (Float16Optimizer's
    main_param, the distributed optimizer's shard_main_param) are neither module
    parameters nor optimizer state, yet hold 4 bytes per parameter (per shard with
    the distributed optimizer): they sleep with the optimizer. Under float32 the
    inner optimizer steps the model's own parameters (or views of DDP's param
    buffer), which the PARAMETERS part already moves and which must not be listed
    twice: only storages of their own count. Listed once, at construction: the
    optimizer keeps these tensors (checkpoint loads copy into them).
    """
    model_storages = {
        t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
    }
    return [
        p
        for inner in inner_optimizers
        for group in inner.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() not in model_storages
    ]
