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
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ppo_lifecycle import ALL_PARTS, OffloadManager, Part
from torch import nn

from ppo_trainer._backend import (
    Batch,
    ForwardFn,
    LossFn,
    Mesh,
    lr_multiplier,
    sum_floats_over_ranks,
)
from ppo_trainer._config import ActorConfig, CriticConfig
from ppo_trainer._megatron_rules import (
    MegatronConfigError,
    data_parallel_size,
    mesh_problems,
    option_problems,
)
from ppo_trainer._offload import (
    CommunicatorSuspender,
    SuspendableComm,
    nccl_communicators,
    process_groups,
    resolve_offload_backend,
)
from ppo_trainer._torch_backend import (
    build_causal_lm,
    build_value_model,
    resolve_device,
    tcp_rendezvous_store,
)
from ppo_trainer.megatron import _convert
from ppo_trainer.megatron._cpu_shim import cuda_as_cpu
from ppo_trainer.megatron._options import MegatronOptions, parse_options
from ppo_trainer.megatron._support import MODEL_FAMILY, model_config_problems

with warnings.catch_warnings():
    # megatron-core warns at import time that Transformer Engine / Apex are missing (it
    # falls back to torch implementations: the expected CPU set-up) and about its own
    # deprecated import paths; only warnings raised from megatron modules are silenced.
    for _category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=_category, module=r"megatron\.")
    from megatron.core import parallel_state as ps  # type: ignore[import-untyped, unused-ignore]
    from megatron.core.distributed import (  # type: ignore[import-untyped, unused-ignore]
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped, unused-ignore]
    from megatron.core.models.gpt.gpt_layer_specs import (  # type: ignore[import-untyped, unused-ignore]
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.optimizer import (  # type: ignore[import-untyped, unused-ignore]
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron.core.pipeline_parallel import (  # type: ignore[import-untyped, unused-ignore]
        get_forward_backward_func,
    )
    from megatron.core.tensor_parallel import (  # type: ignore[import-untyped, unused-ignore]
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer import TransformerConfig  # type: ignore[import-untyped, unused-ignore]
    from megatron.core.transformer.transformer_layer import (  # type: ignore[import-untyped, unused-ignore]
        get_transformer_layer_offset,
    )

__all__ = [
    "MegatronBackend",
    "MegatronFrozenModel",
    "MegatronTrainModel",
    "create_backend",
    "transformer_engine_available",
]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports and CUDA is present (the TE layer spec is usable)."""
    if not torch.cuda.is_available():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformer_engine.pytorch  # noqa: F401  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False
    return True


@contextlib.contextmanager
def _megatron_call() -> Iterator[None]:
    """Every call into megatron-core: the CPU shim (without CUDA) and megatron's own
    deprecation / fallback warnings silenced (only those raised from megatron modules)."""
    with warnings.catch_warnings(), cuda_as_cpu():
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"megatron\.")
        # megatron's buffers (distributed optimizer) call collectives that torch 2.14
        # deprecates; the warning is attributed to torch's c10d wrapper, not to megatron.
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)`",
            category=FutureWarning,
        )
        yield


# --- process groups ---------------------------------------------------------------------


def _init_distributed(
    *, rank: int, world_size: int, dist_init_method: str | None, device: torch.device
) -> None:
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"world_size={world_size}, rank={rank} do not match the process group already "
                f"initialised in this process (world_size={dist.get_world_size()}, "
                f"rank={dist.get_rank()}); use one group layout per process"
            )
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


# --- model construction -----------------------------------------------------------------


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return float(theta)


def _layout(hf_config: Any, *, te: bool, critic: bool) -> _convert.Layout:
    problems = model_config_problems(hf_config)
    if problems:
        raise ValueError(
            f"the megatron backend cannot build this model: {'; '.join(problems)}. It builds "
            f"the {'/'.join(MODEL_FAMILY)} family with plain RoPE; use such a model or "
            "backend='torch'"
        )
    model_type = hf_config.model_type
    heads = int(hf_config.num_attention_heads)
    qkv_bias = model_type == "qwen2"  # Llama with attention_bias is refused above
    return _convert.Layout(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=int(hf_config.num_key_value_heads),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) and not critic,
        te_norm_names=te,
        critic=critic,
    )


class ValueHead(nn.Module):
    """The critic's scalar head in place of ``GPTModel.output_layer``.

    Called as the output layer is (``hidden [s, b, h] -> ([s, b, 1], None)``); replicated
    on every tensor-parallel rank (its input, the final hidden state, is replicated).
    """

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(
        self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        return F.linear(hidden_states, self.weight, self.bias), None


def _transformer_config(
    hf_config: Any, lay: _convert.Layout, opts: MegatronOptions, *, dtype: torch.dtype, te: bool
) -> Any:
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    problems = mesh_problems(
        world_size=tp * pp,  # the ranks are checked at model-parallel initialisation
        tp=tp,
        pp=pp,
        heads=lay.num_attention_heads,
        kv_heads=lay.num_key_value_heads,
        vocab=hf_config.vocab_size,
        layers=lay.num_layers,
        prefix=opts.prefix,
    )
    if opts.fp8_param and not te:  # the option rule, with the layer spec this backend chose
        options = {"fp8_param": True, "transformer_impl": opts.transformer_impl}
        problems += option_problems(options, prefix=opts.prefix, te_available=False)
    if problems:
        raise MegatronConfigError(problems)
    fp8: dict[str, Any] = {}
    if opts.fp8_param:
        fp8 = {"fp8": "hybrid", "fp8_recipe": opts.fp8_recipe or "delayed", "fp8_param": True}
    return TransformerConfig(
        num_layers=lay.num_layers,
        hidden_size=lay.hidden_size,
        num_attention_heads=lay.num_attention_heads,
        num_query_groups=lay.num_key_value_heads,
        kv_channels=lay.head_dim,
        ffn_hidden_size=int(hf_config.intermediate_size),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=lay.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        sequence_parallel=False,
        cuda_graph_scope=[],  # the default ("full") warns that it is deprecated
        use_cpu_initialization=not torch.cuda.is_available(),
        # Every weight is overwritten from the HF model, but megatron's layers set the
        # tensor-parallel attributes (``tensor_model_parallel``, used by the grad norm)
        # only inside their initialisation: keep it on.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,  # no loss / gradient rescaling anywhere
        **fp8,
    )


# --- models -----------------------------------------------------------------------------


class MegatronFrozenModel:
    """A megatron ``GPTModel`` (policy, reference or critic) on one rank, forward only."""

    def __init__(
        self,
        gpt: nn.Module,
        *,
        layout: _convert.Layout,
        device: torch.device,
        offset: int,
        name: str = "reference",
    ) -> None:
        self.gpt = gpt
        self.module: nn.Module = gpt
        self.layout = layout
        self.device = device
        self.offset = offset
        # Storage-level host copies: megatron's parameters (and main_grad) are views into
        # DDP's contiguous buffers, which move as whole storages and keep every view valid.
        self.lifecycle = OffloadManager(
            gpt, None, device=device, backend="host_copy", name=name, keep_gradients=False
        )

    # -- running ------------------------------------------------------------------------
    def _output(self, output: torch.Tensor) -> torch.Tensor:
        if self.layout.critic:
            return output.squeeze(-1).float()
        return output.float()

    def _module_forward(self, mb: Batch) -> torch.Tensor:
        ids = mb["input_ids"]
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
        out: torch.Tensor = self.module(ids, positions, self._attention_mask(mb))
        return out

    def _attention_mask(self, mb: Batch) -> torch.Tensor | None:
        """Causal + key padding, ``[b, 1, T, T]``, True = masked (the local spec's format).

        Right padding never changes the real positions under a causal mask, but the pad
        positions then also match transformers (which masks pad keys). The Transformer
        Engine spec runs its causal kernel without a mask (real positions identical).
        """
        attn = mb.get("attention_mask")
        if self.layout.te_norm_names or attn is None or bool(attn.all()):
            return None
        t = attn.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=attn.device).tril()
        allowed = causal[None, None] & attn.bool()[:, None, None, :]
        return ~allowed

    def _run(
        self,
        micro_batches: Sequence[Batch],
        *,
        last_stage_fn: Any,
        forward_only: bool,
    ) -> list[Any]:
        """Run each micro-batch through megatron's schedule; ``last_stage_fn(out, mb)``
        returns ``(loss, payload)`` on the last pipeline stage. Returns the payloads."""
        results: list[Any] = []
        fb = get_forward_backward_func()
        for mb in micro_batches:
            b, t = mb["input_ids"].shape

            def loss_func(mb: Batch, output: torch.Tensor) -> Any:
                loss, payload = last_stage_fn(self._output(output), mb)
                one = torch.ones((), dtype=torch.int, device=output.device)
                return loss, one, {"payload": payload}

            def forward_step(data_iterator: Iterator[Batch], model: nn.Module) -> Any:
                mb = next(data_iterator)
                return self._module_forward(mb), partial(loss_func, mb)

            store = fb(
                forward_step_func=forward_step,
                data_iterator=iter([mb]),
                model=[self.module],
                num_microbatches=1,
                seq_length=t,
                micro_batch_size=b,
                forward_only=forward_only,
            )
            results.append(store[0]["payload"] if store else None)
        return results

    def _broadcast_from_last_stage(
        self, values: list[Any], shapes: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return list(values)
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        out = []
        for value, shape in zip(values, shapes, strict=True):
            t = (
                value
                if value is not None
                else torch.empty(shape, dtype=torch.float32, device=self.device)
            )
            t = t.to(torch.float32).contiguous()
            dist.broadcast(t, src=src, group=group)
            out.append(t)
        return out

    def forward(self, micro_batches: Sequence[Batch], *, fn: ForwardFn) -> list[torch.Tensor]:
        with _megatron_call(), torch.no_grad():
            self.module.eval()
            if ps.get_pipeline_model_parallel_world_size() == 1:
                return [
                    fn(self._output(self._module_forward(mb)), mb).detach() for mb in micro_batches
                ]
            zero = torch.zeros((), device=self.device)
            payloads = self._run(
                micro_batches,
                last_stage_fn=lambda out, mb: (zero, fn(out, mb).detach()),
                forward_only=True,
            )
            shapes = [tuple(mb["input_ids"].shape) for mb in micro_batches]
            return self._broadcast_from_last_stage(payloads, shapes)  # type: ignore[arg-type]

    # -- weights ------------------------------------------------------------------------
    def _named_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self.gpt.named_parameters():
            yield _convert.global_name(name, offset=self.offset), p

    def export_hf(self) -> dict[str, torch.Tensor]:
        with _megatron_call(), torch.no_grad():
            full = self._gather_full()
        return {
            k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in _convert.megatron_to_hf(full, self.layout).items()
        }

    def _gather_full(self) -> dict[str, torch.Tensor]:
        """Every full megatron tensor (global names), on every rank, on the CPU."""
        tp = ps.get_tensor_model_parallel_world_size()
        tp_group = ps.get_tensor_model_parallel_group()
        mine: dict[str, torch.Tensor] = {}
        for name, p in self._named_params():
            data = p.detach()
            if tp > 1 and _convert.is_tensor_parallel(name, critic=self.layout.critic):
                shards = [torch.empty_like(data) for _ in range(tp)]
                dist.all_gather(shards, data.contiguous(), group=tp_group)
                data = _convert.unshard(name, shards, critic=self.layout.critic)
            mine[name] = data.to("cpu", copy=True)
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return mine
        parts: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, mine, group=ps.get_pipeline_model_parallel_group())
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return full

    def load_hf(self, state: Mapping[str, torch.Tensor]) -> None:
        full = _convert.hf_to_megatron(state, self.layout)
        tp_rank = ps.get_tensor_model_parallel_rank()
        tp = ps.get_tensor_model_parallel_world_size()
        with _megatron_call(), torch.no_grad():
            for name, p in self._named_params():
                source = name
                if name == "output_layer.weight" and self.layout.tie_word_embeddings:
                    # Tied embeddings under pipeline parallelism: the last stage holds its
                    # own copy of the embedding as the output layer (megatron keeps the two
                    # equal by summing their gradients in finalize_model_grads). It is
                    # vocab-parallel like the embedding, so the same shard fills it.
                    source = "embedding.word_embeddings.weight"
                if source not in full:
                    raise KeyError(f"megatron weight {name!r} has no HF source")
                value = _convert.shard(
                    name, full[source], rank=tp_rank, size=tp, critic=self.layout.critic
                )
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"weight {name}: HF gives shape {tuple(value.shape)}, megatron has "
                        f"{tuple(p.shape)}"
                    )
                p.copy_(value.to(dtype=p.dtype, device=p.device))
        self._after_load()

    def _after_load(self) -> None:
        """Hook: the train model refreshes the optimizer's main parameters."""

    # -- sleep / wake_up ----------------------------------------------------------------
    def sleep(self, *, parts: frozenset[Part]) -> None:
        self.lifecycle.sleep(parts=parts)

    def wake_up(self, *, parts: frozenset[Part] = ALL_PARTS) -> None:
        self.lifecycle.wake_up(parts=parts)


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
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=opts.use_distributed_optimizer,
            use_megatron_fsdp=False,
        )
        with _megatron_call():
            self.ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=gpt)
            self.module = self.ddp
            dtype = tconfig.params_dtype
            opt_config = OptimizerConfig(
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
        # The mixed-precision optimizers' fp32 main parameters (Float16Optimizer's
        # main_param, the distributed optimizer's shard_main_param) are neither module
        # parameters nor optimizer state, yet hold 4 bytes per parameter (per shard with
        # the distributed optimizer): they sleep with the optimizer. Under float32 the
        # inner optimizer steps the model's own parameters (or views of DDP's param
        # buffer), which the PARAMETERS part already moves and which must not be listed
        # twice: only storages of their own count. Listed once, here: the optimizer keeps
        # these tensors (checkpoint loads copy into them).
        model_storages = {
            t.untyped_storage().data_ptr() for t in (*gpt.parameters(), *gpt.buffers())
        }
        self._main_params = [
            p
            for inner in self._inner_optimizers()
            for group in inner.param_groups
            for p in group["params"]
            if isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() not in model_storages
        ]
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
        optim: list[dict[str, Any]] = []
        for chained in self._chained():
            inner = chained.optimizer
            params = [p for g in inner.param_groups for p in g["params"]]
            state: dict[str, Any] = {}
            for i, p in enumerate(params):
                if p in inner.state:
                    state[str(i)] = {
                        k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                        for k, v in inner.state[p].items()
                    }
            # The inner optimizer's parameters are the main (fp32) copies under mixed
            # precision or the distributed optimizer: saved too, so a restore is exact.
            main = {str(i): p.detach().to("cpu", copy=True) for i, p in enumerate(params)}
            # The param groups' own entries (lr, betas, eps, megatron's multipliers, and
            # the step counter that TE's FusedAdam keeps there rather than per parameter)
            # and float16's loss scaler: without them a restore restarts Adam's bias
            # correction and the loss scale.
            groups = [
                {k: _to_cpu(v) for k, v in g.items() if k != "params" and _saveable(v)}
                for g in inner.param_groups
            ]
            scaler = getattr(chained, "grad_scaler", None)
            optim.append(
                {
                    "state": state,
                    "num_params": len(params),
                    "main_params": main,
                    "param_groups": groups,
                    "grad_scaler": None
                    if scaler is None
                    else {k: _to_cpu(v) for k, v in scaler.state_dict().items()},
                }
            )
        return {"model": model, "optimizer": optim, "scheduler": {"step": self._steps}}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        model = state["model"]
        with _megatron_call(), torch.no_grad():
            for name, p in self._named_params():
                p.copy_(model[name].to(dtype=p.dtype, device=p.device))
            chained_all = self._chained()
            inners = [c.optimizer for c in chained_all]
            if len(inners) != len(state["optimizer"]):
                raise ValueError("checkpoint optimizer layout differs from this model's")
            for chained, saved in zip(chained_all, state["optimizer"], strict=True):
                inner = chained.optimizer
                params = [p for g in inner.param_groups for p in g["params"]]
                if int(saved["num_params"]) != len(params):
                    raise ValueError("checkpoint optimizer layout differs from this model's")
                # Checkpoints written before these entries existed lack them: the groups
                # keep their fresh values and the scaler its initial state, as before.
                groups = saved.get("param_groups")
                if groups is not None:
                    if len(groups) != len(inner.param_groups):
                        raise ValueError("checkpoint optimizer layout differs from this model's")
                    for group, values in zip(inner.param_groups, groups, strict=True):
                        group.update(
                            {k: _to_device(v, _group_device(group)) for k, v in values.items()}
                        )
                scaler = getattr(chained, "grad_scaler", None)
                if scaler is not None and saved.get("grad_scaler") is not None:
                    scaler.load_state_dict(dict(saved["grad_scaler"]))
                inner.state.clear()
                for key, values in saved["state"].items():
                    p = params[int(key)]
                    inner.state[p] = {
                        k: (v.to(p.device) if isinstance(v, torch.Tensor) else v)
                        for k, v in values.items()
                    }
            self.optimizer.reload_model_params()
            for inner, saved in zip(inners, state["optimizer"], strict=True):
                params = [p for g in inner.param_groups for p in g["params"]]
                for i, p in enumerate(params):
                    p.copy_(saved["main_params"][str(i)].to(dtype=p.dtype, device=p.device))
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


def _saveable(value: Any) -> bool:
    """What a checkpoint can hold without pickle (``ppo_trainer._serialize``): tensors,
    JSON scalars and tuples / lists of them. Anything else in a param group (none in
    megatron-core 0.16's groups) is left at the restored model's value."""
    if isinstance(value, tuple | list):
        return all(_saveable(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | torch.Tensor)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _group_device(group: Mapping[str, Any]) -> torch.device:
    """The device of a param group's parameters (where its tensor entries live)."""
    params = group["params"]
    return params[0].device if params else torch.device("cpu")


# --- the backend --------------------------------------------------------------------------


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
        impl = self.opts.transformer_impl
        te_ok = transformer_engine_available()
        if impl == "transformer_engine" and not te_ok:
            raise ValueError(
                f"{self.opts.prefix}.transformer_impl='transformer_engine' needs CUDA and the "
                f"`te` extra: install it or set {self.opts.prefix}.transformer_impl='local'"
            )
        self.use_te = te_ok if impl == "auto" else impl == "transformer_engine"
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
    def _build(
        self, *, critic: bool
    ) -> tuple[nn.Module, _convert.Layout, int, Any, dict[str, torch.Tensor]]:
        spec = self.config.model
        hf = build_value_model(spec) if critic else build_causal_lm(spec)
        hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
        hf_config: Any = hf.config
        lay = _layout(hf_config, te=self.use_te, critic=critic)
        dtype = _DTYPES[spec.dtype]
        # megatron's CPU initialisation draws from the global generator: leave it untouched.
        with _megatron_call(), torch.random.fork_rng(devices=[]):
            tconfig = _transformer_config(hf_config, lay, self.opts, dtype=dtype, te=self.use_te)
            layer_spec = (
                get_gpt_layer_with_transformer_engine_spec()
                if self.use_te
                else get_gpt_layer_local_spec(normalization="RMSNorm")
            )
            pre = ps.is_pipeline_first_stage()
            post = ps.is_pipeline_last_stage()
            gpt = GPTModel(
                config=tconfig,
                transformer_layer_spec=layer_spec,
                vocab_size=int(hf_config.vocab_size),
                max_sequence_length=int(hf_config.max_position_embeddings),
                pre_process=pre,
                post_process=post,
                parallel_output=False,  # gather the full vocabulary for the worker
                share_embeddings_and_output_weights=lay.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_percent=1.0,
                rotary_base=_rope_theta(hf_config),
            )
            if critic and post:
                gpt.output_layer = ValueHead(lay.hidden_size, dtype=dtype, device=self.device)
            gpt.to(self.device)
            offset = get_transformer_layer_offset(tconfig)
        return gpt, lay, offset, tconfig, hf_state

    def _build_trainable(self, *, critic: bool) -> MegatronTrainModel:
        gpt, lay, offset, tconfig, hf_state = self._build(critic=critic)
        model = MegatronTrainModel(
            gpt,
            layout=lay,
            device=self.device,
            offset=offset,
            config=self.config,
            opts=self.opts,
            tconfig=tconfig,
            name="critic" if critic else "actor",
        )
        model.load_hf(hf_state)
        return model

    def build_policy(self) -> MegatronTrainModel:
        return self._build_trainable(critic=False)

    def build_reference(self) -> MegatronFrozenModel:
        gpt, lay, offset, _, hf_state = self._build(critic=False)
        gpt.requires_grad_(False)
        model = MegatronFrozenModel(gpt, layout=lay, device=self.device, offset=offset)
        model.load_hf(hf_state)
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
