"""Model construction of the megatron backend: a megatron-core ``GPTModel`` in megatron's
own layout for the Hugging Face model of a ``ModelSpec``, with the weights to fill it.

The HF model is built by the torch backend (``build_causal_lm`` / ``build_value_model``),
so both backends start from identical weights (converted by :mod:`._convert`). The layer
spec is Transformer Engine's when ``te`` (TE imports and CUDA is present), the local
(pure megatron-core) spec otherwise. The critic is the same ``GPTModel`` whose output
layer is replaced by a scalar value head (:class:`ValueHead`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ppo_trainer._config import ModelSpec
from ppo_trainer._megatron_rules import MegatronConfigError, mesh_problems, option_problems
from ppo_trainer._torch_backend import build_causal_lm, build_value_model
from ppo_trainer.megatron import _convert
from ppo_trainer.megatron._core import (
    GPTModel,
    TransformerConfig,
    _megatron_call,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_transformer_layer_offset,
    ps,
)
from ppo_trainer.megatron._options import MegatronOptions
from ppo_trainer.megatron._support import MODEL_FAMILY, model_config_problems

__all__ = ["BuiltGPT", "ValueHead", "_layout", "build_gpt"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class BuiltGPT(NamedTuple):
    """A freshly built ``GPTModel`` (this rank's pipeline stage) and what goes with it."""

    gpt: nn.Module
    layout: _convert.Layout
    offset: int  # the global index of this stage's first layer
    tconfig: Any  # megatron's TransformerConfig
    hf_state: dict[str, torch.Tensor]  # the HF weights to fill it with (``load_hf``)


def build_gpt(
    spec: ModelSpec,
    opts: MegatronOptions,
    *,
    use_te: bool,
    device: torch.device,
    critic: bool,
) -> BuiltGPT:
    """Build this rank's stage of the policy (``critic=False``) or critic ``GPTModel`` on
    ``device``, and the HF weights of ``spec`` to load into it."""
    hf = build_value_model(spec) if critic else build_causal_lm(spec)
    hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    hf_config: Any = hf.config
    lay = _layout(hf_config, te=use_te, critic=critic)
    dtype = _DTYPES[spec.dtype]
    # megatron's CPU initialisation draws from the global generator: leave it untouched.
    with _megatron_call(), torch.random.fork_rng(devices=[]):
        tconfig = _transformer_config(hf_config, lay, opts, dtype=dtype, te=use_te)
        layer_spec = (
            get_gpt_layer_with_transformer_engine_spec()
            if use_te
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
            gpt.output_layer = ValueHead(lay.hidden_size, dtype=dtype, device=device)
        gpt.to(device)
        offset = get_transformer_layer_offset(tconfig)
    return BuiltGPT(gpt, lay, offset, tconfig, hf_state)
