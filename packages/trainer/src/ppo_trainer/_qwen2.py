"""The built-in model (a ``ModelSpec`` without ``path``) as the workers and the embedded
engine build it (``build_causal_lm`` / ``build_value_model(..., plain_torch=True)``): the
Qwen2 architecture in plain torch, with transformers' parameter names, initialisation
and numerics.

Why not transformers' own class: importing ``transformers``' model classes costs about
2.4 CPU-seconds per process (dynamo, ``torch.distributed.tensor``, version checks), paid
by every trainer rank and engine at start-up. The forward costs the same (measured on
the built-in sizes, 256 x 20 tokens). This module imports only torch.

What stays equal to ``transformers.Qwen2ForCausalLM`` / ``Qwen2ForTokenClassification``
(``num_labels=1``) built by ``from_config`` under the same seed (the tests check each):

* the state dict: the same keys and shapes, and the same initial values bit for bit
  (normal(0, 0.02) for linear and embedding weights drawn in transformers' order, zero
  biases, unit norms), so an export loads with transformers' ``from_pretrained`` and a
  run keeps the weights it had with transformers' class;
* the forward: logits within float rounding of transformers' (RMSNorm in float32, rotary
  tables in float32 cast to the activations' dtype, positions ``0..T-1`` from the cache
  length whatever the mask, as transformers numbers them; keys masked by
  ``attention_mask``);
* the KV cache the embedded engine uses (``past_key_values``, ``batch_select_indices``).

A model directory (``ModelSpec.path``) always loads through transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KVCache", "Qwen2CausalLM", "Qwen2Output", "Qwen2Spec", "Qwen2TokenValue"]

_INIT_STD = 0.02  # transformers' Qwen2Config.initializer_range


@dataclass
class Qwen2Spec:
    """The architecture's sizes (``ModelSpec.hf_config_kwargs()``), read as ``model.config``.

    ``to_hf()`` gives the matching ``transformers.Qwen2Config`` (it imports transformers):
    the one place the built-in model's transformers config is made (transformers' own
    class of a spec, the HF export).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_labels: int | None = None  # the value model's head width
    use_cache: bool = False
    model_type: str = field(default="qwen2", init=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self) -> Any:
        from transformers import Qwen2Config

        config_cls: Any = Qwen2Config  # rope_theta: a keyword transformers 5 still reads
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if kwargs.pop("num_labels") is not None:  # the value model: no dropout in its head
            kwargs.update(num_labels=self.num_labels, classifier_dropout=0.0)
        return config_cls(**kwargs)


@dataclass
class Qwen2Output:
    """What the callers read of transformers' model outputs."""

    logits: torch.Tensor
    past_key_values: KVCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class KVCache:
    """Keys and values per layer, ``[B, kv_heads, S, head_dim]``, grown by each forward."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def get_seq_length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[2])

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            key, value = torch.cat([old_k, key], dim=2), torch.cat([old_v, value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (rows that finished leave the batch)."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, indices)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, kv_heads, S, D]`` -> ``[B, kv_heads * rep, S, D]``: each key/value head
    repeated for the ``rep`` query heads that share it (grouped-query attention)."""
    if rep == 1:
        return t
    b, kv, s, d = t.shape
    return t[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)


class Attention(nn.Module):
    def __init__(self, spec: Qwen2Spec, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        hd, heads, kv = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
        self.layer, self.head_dim, self.heads, self.kv_heads = layer, hd, heads, kv
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, heads * hd, bias=True, dtype=dtype)
        self.k_proj = nn.Linear(h, kv * hd, bias=True, dtype=dtype)
        self.v_proj = nn.Linear(h, kv * hd, bias=True, dtype=dtype)
        self.o_proj = nn.Linear(heads * hd, h, bias=False, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        rep = self.heads // self.kv_heads
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and t > 1, scale=self.head_dim**-0.5
        )
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class MLP(nn.Module):
    def __init__(self, spec: Qwen2Spec, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, spec: Qwen2Spec, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer, dtype)
        self.mlp = MLP(spec, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Qwen2Model(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' ``model.*``)."""

    inv_freq: torch.Tensor  # the rotary frequencies (a buffer outside the state dict)

    def __init__(self, spec: Qwen2Spec, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [DecoderLayer(spec, i, dtype) for i in range(spec.num_hidden_layers)]
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: KVCache | None,
        hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final hidden states; ``hidden`` (if given) collects transformers'
        ``hidden_states``: the embeddings, each layer's output but the last, and the
        final (normed) output."""
        x = self.embed_tokens(input_ids)
        t = input_ids.shape[1]
        past = 0 if cache is None else cache.get_seq_length()
        positions = torch.arange(past, past + t, device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = _attention_mask(attention_mask, t, past, x.device)
        for layer in self.layers:
            if hidden is not None:
                hidden.append(x)
            x = layer(x, cos, sin, mask, cache)
        out: torch.Tensor = self.norm(x)
        if hidden is not None:
            hidden.append(out)
        return out


def _attention_mask(
    attention_mask: torch.Tensor | None, t: int, past: int, device: torch.device
) -> torch.Tensor | None:
    """``[B, 1, t, past + t]`` booleans (True: attend), or None for plain causal attention
    (``is_causal`` when there is no cache; one new token sees every cached key), as
    transformers' sdpa masks: a key is seen when it is not after the query and
    ``attention_mask`` marks it valid. (Padding queries see the valid keys before them,
    as in transformers; the losses mask their outputs.)"""
    if attention_mask is None or bool(attention_mask.all()):
        if past == 0 or t == 1:
            return None
        attention_mask = torch.ones(1, past + t, dtype=torch.bool, device=device)
    s = past + t
    causal = (
        torch.arange(s, device=device)[None, :] <= torch.arange(past, s, device=device)[:, None]
    )
    return causal & attention_mask[:, None, None, :].to(torch.bool)


class _Qwen2Base(nn.Module):
    def __init__(self, spec: Qwen2Spec, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = spec
        self.model = Qwen2Model(spec, dtype)
        _init_weights(self.model)


def _init_weights(module: nn.Module) -> None:
    """transformers' initialisation, in its order: a module's children depth-first before
    the module itself, linear and embedding weights from normal(0, 0.02) (after torch's
    own initialisation at construction, which draws from the generator too), biases
    zero, norms one. transformers initialises the base model as it is built, then the
    head once built: the callers follow that order."""
    with torch.no_grad():
        for child in module.children():
            _init_weights(child)
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, _INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


class Qwen2CausalLM(_Qwen2Base):
    """``Qwen2ForCausalLM``'s parameters (``model.*``, ``lm_head``) and forward."""

    def __init__(self, spec: Qwen2Spec, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(spec, dtype)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        _init_weights(self.lm_head)  # drawn even when tied, as transformers does
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
    ) -> Qwen2Output:
        cache = past_key_values
        if use_cache and cache is None:
            cache = KVCache(self.config.num_hidden_layers)
        states: list[torch.Tensor] | None = [] if output_hidden_states else None
        out = self.model(input_ids, attention_mask, cache, states)
        return Qwen2Output(
            logits=self.lm_head(out),
            past_key_values=cache if use_cache else None,
            hidden_states=None if states is None else tuple(states),
        )


class Qwen2TokenValue(_Qwen2Base):
    """``Qwen2ForTokenClassification``'s parameters (``model.*``, ``score`` with a bias)
    and forward (no dropout): one value per position, ``logits`` ``[B, T, num_labels]``."""

    def __init__(self, spec: Qwen2Spec, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(spec, dtype)
        labels = 1 if spec.num_labels is None else spec.num_labels
        self.score = nn.Linear(spec.hidden_size, labels, bias=True, dtype=dtype)
        _init_weights(self.score)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
    ) -> Qwen2Output:
        del past_key_values, use_cache  # a value model runs whole sequences
        states: list[torch.Tensor] | None = [] if output_hidden_states else None
        out = self.model(input_ids, attention_mask, None, states)
        return Qwen2Output(
            logits=self.score(out), hidden_states=None if states is None else tuple(states)
        )
