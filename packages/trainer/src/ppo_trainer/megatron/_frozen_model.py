"""A megatron ``GPTModel`` on one rank, forward only (the reference model; the base of
the trained models): running micro-batches through megatron's schedule, the weights in
Hugging Face names, and sleep / wake_up through storage-level host copies."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from ppo_lifecycle import ALL_PARTS, OffloadManager, Part
from torch import nn

from ppo_trainer._backend import Batch, ForwardFn
from ppo_trainer.megatron import _convert
from ppo_trainer.megatron._core import _megatron_call, get_forward_backward_func, ps

__all__ = ["MegatronFrozenModel"]


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
        """Every full megatron tensor (global names), on every rank, on the CPU.

        One tensor at a time: its tensor-parallel slices are gathered on the device, and
        with pipeline parallelism each stage broadcasts its tensors to the other stages
        (the names, shapes and dtypes go first, as one small object per stage). No rank
        holds more than one full tensor on the device at once, and no weights are
        pickled (an object gather of whole stages goes through the device as one padded
        byte tensor per stage on every rank)."""
        params = dict(self._named_params())
        pp = ps.get_pipeline_model_parallel_world_size()
        if pp == 1:
            return {
                name: self._full_tensor(name, p).to("cpu", copy=True) for name, p in params.items()
            }
        group = ps.get_pipeline_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
        critic = self.layout.critic
        mine = [
            (name, _convert.full_shape(name, tuple(p.shape), size=tp, critic=critic), p.dtype)
            for name, p in params.items()
        ]
        stages: list[Any] = [None] * pp
        dist.all_gather_object(stages, mine, group=group)
        here = ps.get_pipeline_model_parallel_rank()
        full: dict[str, torch.Tensor] = {}
        for stage, layout in enumerate(stages):
            src = dist.get_global_rank(group, stage)
            for name, shape, dtype in layout:
                if stage == here:
                    t = self._full_tensor(name, params[name]).contiguous()
                else:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(t, src=src, group=group)
                full[name] = t.to("cpu", copy=True)
        return full

    def _full_tensor(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """``p`` (this rank's slice of ``name``) whole: its tensor-parallel slices gathered."""
        data = p.detach()
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1 and _convert.is_tensor_parallel(name, critic=self.layout.critic):
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data.contiguous(), group=ps.get_tensor_model_parallel_group())
            data = _convert.unshard(name, shards, critic=self.layout.critic)
        return data

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
