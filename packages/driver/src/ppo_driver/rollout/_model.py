"""Build the Hugging Face causal LM the engine runs: the trainer's architecture, from
the same model spec (``ppo_trainer.ModelSpec``: a local HF directory, or a tiny Qwen2
config plus a seed), a ``transformers`` config, or a local HF directory path."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from ppo_trainer import ModelSpec, build_causal_lm

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ModelSource: TypeAlias = "ModelSpec | PretrainedConfig | str | Path"
"""What :func:`build_model` builds a causal LM from."""


def build_model(
    source: ModelSource, *, seed: int | None = None, device: str = "cpu"
) -> torch.nn.Module:
    """A causal LM in eval mode on ``device``.

    ``source`` may be: a ``ppo_trainer.ModelSpec`` (built by the trainer's own
    ``build_causal_lm``, so the engine starts from the trainer's initial weights); a
    ``transformers.PretrainedConfig`` (random init seeded by ``seed``, default 0); or a
    path to a local HF model directory.
    """
    if isinstance(source, ModelSpec):
        # exactly the trainer's construction: same seed, same weights, same names (the
        # built-in model does not import transformers)
        return build_causal_lm(source, device=device, plain_torch=True).eval()
    import transformers
    from transformers import PretrainedConfig

    auto: Any = transformers.AutoModelForCausalLM

    model: torch.nn.Module
    if isinstance(source, str | Path):
        if not Path(source).is_dir():
            raise ValueError(f"model path {str(source)!r} is not a directory")
        model = auto.from_pretrained(str(source), local_files_only=True)
    elif isinstance(source, PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else seed)
            model = auto.from_config(source)
    else:
        raise ValueError(
            f"model source {type(source).__name__}: pass a ppo_trainer.ModelSpec, a "
            "transformers config or a local model directory"
        )
    return model.to(device=device).eval()


def tiny_qwen2_config(
    *, vocab_size: int = 32, hidden_size: int = 32, num_layers: int = 2
) -> PretrainedConfig:
    """A tiny Qwen2 config for tests and benchmarks."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
