"""Which Hugging Face checkpoints the megatron backend can build (no megatron import).

The backend builds megatron-core's ``GPTModel`` for the Llama / Qwen2 family: RMSNorm,
SwiGLU (``silu``), plain RoPE, no bias outside Qwen2's q/k/v projections, full
attention. :func:`model_config_problems` names what a checkpoint's config has beyond
that; the backend refuses such a model at build time, and ``ppo-driver validate`` asks
the same function before anything starts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_FAMILY", "model_config_problems"]

#: ``config.model_type`` values the backend builds.
MODEL_FAMILY: tuple[str, ...] = ("qwen2", "llama")


def rope_type(hf_config: Any) -> str:
    """The RoPE variant of ``hf_config`` (``"default"``: plain RoPE)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, name, None)
        if isinstance(params, dict):
            kind = params.get("rope_type", params.get("type", "default"))
            return str(kind)
    return "default"


def model_config_problems(hf_config: Any) -> list[str]:
    """What of ``hf_config`` (a transformers ``PretrainedConfig``) the megatron backend
    cannot build, one sentence each naming the config field and its value; empty when
    the model is supported."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_FAMILY:
        return [f"model_type={model_type!r} is not one of {', '.join(MODEL_FAMILY)}"]
    problems = []
    kind = rope_type(hf_config)
    if kind != "default":
        problems.append(f"rope_type={kind!r} is not plain RoPE ('default')")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} is not 'silu' (SwiGLU)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True (the MLP projections have biases)")
    if model_type == "llama" and getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (Llama's output projection then has a bias)")
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True (only full attention is built)")
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    if heads > 0:
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        if head_dim * heads != hidden:
            problems.append(
                f"head_dim={head_dim} x num_attention_heads={heads} != hidden_size={hidden}"
            )
    return problems
