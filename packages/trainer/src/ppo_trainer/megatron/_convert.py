"""Hugging Face <-> megatron-core weight conversion for the Llama / Qwen2 family.

Pure tensor functions (no megatron import), in three layers:

* :func:`hf_to_megatron` / :func:`megatron_to_hf`: full (unsharded) tensors, HF names
  <-> megatron ``GPTModel`` names with GLOBAL layer indices.
* :func:`shard` / :func:`unshard`: one full megatron tensor <-> the slice a tensor-parallel
  rank holds.
* :func:`local_name` / :func:`global_name`: global layer index <-> the index inside a
  pipeline stage.

Layouts megatron uses (HF ``nn.Linear`` weights are ``[out, in]``, as are megatron's):

* ``linear_qkv``: q, k and v fused along the output dim, GROUPED by key/value head:
  for each of the ``G = num_key_value_heads`` groups, the ``H / G`` query heads of
  that group, then its key head, then its value head (each ``head_dim`` rows). The
  bias (Qwen2 has one, Llama not) uses the same row order. Tensor parallelism splits
  whole groups, so a contiguous split of the rows is each rank's shard.
* ``linear_fc1``: ``[gate; up]`` (SwiGLU). Tensor parallelism splits gate and up
  separately; rank ``r`` holds ``[gate_r; up_r]``.
* ``linear_proj`` / ``linear_fc2``: row parallel (split along the input dim).
* word embeddings / output layer: vocab parallel (split along dim 0).
* norms: replicated. With the Transformer Engine spec the two per-layer norms live
  inside the fused ``LayerNormLinear`` modules (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``); with the local spec they are separate modules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "VALUE_HEAD_HF",
    "VALUE_HEAD_MEGATRON",
    "Layout",
    "global_name",
    "hf_to_megatron",
    "is_tensor_parallel",
    "local_name",
    "megatron_to_hf",
    "shard",
    "unshard",
]

VALUE_HEAD_MEGATRON = ("output_layer.weight", "output_layer.bias")
"""The critic's value head replaces the output layer, under the same megatron names."""
VALUE_HEAD_HF = ("score.weight", "score.bias")
"""HF names of the critic's value head (``AutoModelForTokenClassification``, ``num_labels=1``):
weight ``[1, hidden]`` and bias ``[1]``."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The architecture numbers the conversion needs."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    qkv_bias: bool
    tie_word_embeddings: bool = False
    te_norm_names: bool = False
    critic: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def input_norm(self, i: int) -> str:
        if self.te_norm_names:
            return f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"
        return f"decoder.layers.{i}.input_layernorm.weight"

    def mlp_norm(self, i: int) -> str:
        if self.te_norm_names:
            return f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight"
        return f"decoder.layers.{i}.pre_mlp_layernorm.weight"


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``q: [H*d, ...]``, ``k, v: [G*d, ...]`` -> ``[(H + 2G)*d, ...]`` grouped."""
    g, d = lay.num_key_value_heads, lay.head_dim
    per = lay.num_attention_heads // g
    rest = q.shape[1:]
    qg = q.reshape(g, per * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    g, d = lay.num_key_value_heads, lay.head_dim
    per = lay.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def _take(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return state[name]
    except KeyError:
        raise KeyError(f"weight {name!r} is missing from the state dict") from None


def hf_to_megatron(hf: Mapping[str, torch.Tensor], lay: Layout) -> dict[str, torch.Tensor]:
    """Full HF tensors -> full megatron tensors (global layer indices).

    ``hf`` holds a causal LM's ``state_dict()`` (``model.*`` + ``lm_head.weight``) or, for
    a critic, ``model.*`` + :data:`VALUE_HEAD_HF`. Unknown names raise ``KeyError``.
    """
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return _take(hf, name)

    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
    }
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        out[lay.input_norm(i)] = take(p + "input_layernorm.weight")
        out[lay.mlp_norm(i)] = take(p + "post_attention_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(p + "self_attn.q_proj.weight"),
            take(p + "self_attn.k_proj.weight"),
            take(p + "self_attn.v_proj.weight"),
            lay,
        )
        if lay.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                take(p + "self_attn.q_proj.bias"),
                take(p + "self_attn.k_proj.bias"),
                take(p + "self_attn.v_proj.bias"),
                lay,
            )
        out[m + "self_attention.linear_proj.weight"] = take(p + "self_attn.o_proj.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = take(p + "mlp.down_proj.weight")
    if lay.critic:
        for meg_name, hf_name in zip(VALUE_HEAD_MEGATRON, VALUE_HEAD_HF, strict=True):
            out[meg_name] = take(hf_name)
    elif not lay.tie_word_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    else:
        used.add("lm_head.weight")  # tied: the same tensor as the embeddings
    extra = sorted(set(hf) - used)
    if extra:
        raise KeyError(f"unexpected HF weights (not in a Llama/Qwen2 model): {extra[:5]}")
    return out


def megatron_to_hf(meg: Mapping[str, torch.Tensor], lay: Layout) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron`; a tied LM also gets ``lm_head.weight``."""
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _take(meg, "embedding.word_embeddings.weight"),
    }
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = _take(meg, lay.input_norm(i))
        q, k, v = _split_qkv(_take(meg, m + "self_attention.linear_qkv.weight"), lay)
        out[p + "self_attn.q_proj.weight"] = q
        out[p + "self_attn.k_proj.weight"] = k
        out[p + "self_attn.v_proj.weight"] = v
        if lay.qkv_bias:
            qb, kb, vb = _split_qkv(_take(meg, m + "self_attention.linear_qkv.bias"), lay)
            out[p + "self_attn.q_proj.bias"] = qb
            out[p + "self_attn.k_proj.bias"] = kb
            out[p + "self_attn.v_proj.bias"] = vb
        out[p + "self_attn.o_proj.weight"] = _take(meg, m + "self_attention.linear_proj.weight")
        out[p + "post_attention_layernorm.weight"] = _take(meg, lay.mlp_norm(i))
        gate, up = torch.chunk(_take(meg, m + "mlp.linear_fc1.weight"), 2, dim=0)
        out[p + "mlp.gate_proj.weight"] = gate.contiguous()
        out[p + "mlp.up_proj.weight"] = up.contiguous()
        out[p + "mlp.down_proj.weight"] = _take(meg, m + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = _take(meg, "decoder.final_layernorm.weight")
    if lay.critic:
        for meg_name, hf_name in zip(VALUE_HEAD_MEGATRON, VALUE_HEAD_HF, strict=True):
            out[hf_name] = _take(meg, meg_name)
    elif lay.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = _take(meg, "output_layer.weight")
    return out


# --- tensor parallelism --------------------------------------------------------------------

_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_COLUMN_PARALLEL = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "embedding.word_embeddings.weight",
)


def _split_dim(name: str, *, critic: bool) -> int | None:
    """The dim a tensor-parallel rank splits ``name`` along (None: replicated)."""
    if name.startswith("output_layer."):
        return None if critic else 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    return None


def _gathered_dim(name: str, *, critic: bool) -> int | None:
    """The dim along which the tensor-parallel slices of ``name`` make up the full tensor
    (``mlp.linear_fc1``: 0, each rank holding a slice of the gate and of the up half;
    None: replicated)."""
    return 0 if name.endswith("mlp.linear_fc1.weight") else _split_dim(name, critic=critic)


def is_tensor_parallel(name: str, *, critic: bool = False) -> bool:
    """Whether tensor-parallel ranks hold different slices of ``name``."""
    return _gathered_dim(name, critic=critic) is not None


def shard(
    name: str, full: torch.Tensor, *, rank: int, size: int, critic: bool = False
) -> torch.Tensor:
    """The slice of the full megatron tensor ``name`` that tensor-parallel ``rank`` holds."""
    if size == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    dim = _split_dim(name, critic=critic)
    if dim is None:
        return full
    if full.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of {tuple(full.shape)} does not split in {size}")
    return full.chunk(size, dim)[rank].contiguous()


def full_shape(
    name: str, shard_shape: tuple[int, ...], *, size: int, critic: bool = False
) -> tuple[int, ...]:
    """The shape :func:`unshard` makes of ``size`` slices of ``shard_shape``."""
    dim = _gathered_dim(name, critic=critic)
    if size == 1 or dim is None:
        return shard_shape
    return (*shard_shape[:dim], shard_shape[dim] * size, *shard_shape[dim + 1 :])


def unshard(name: str, shards: list[torch.Tensor], *, critic: bool = False) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every rank's slice, in rank order."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        pairs = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=0)
    dim = _split_dim(name, critic=critic)
    if dim is None:
        return shards[0]
    return torch.cat(shards, dim=dim)


# --- pipeline parallelism ------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def local_name(name: str, *, offset: int) -> str:
    """Global layer index -> index inside the stage whose first layer is ``offset``."""
    m = _LAYER.match(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) - offset}.{name[m.end() :]}"


def global_name(name: str, *, offset: int) -> str:
    """Inverse of :func:`local_name`."""
    m = _LAYER.match(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) + offset}.{name[m.end() :]}"
