"""The megatron-core names the backend uses, imported once with megatron's import-time
warnings silenced, and the context every call into megatron-core runs in.

Importing this module imports megatron-core (the ``megatron`` extra).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from ppo_trainer.megatron._cpu_shim import cuda_as_cpu

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
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "GPTModel",
    "OptimizerConfig",
    "TransformerConfig",
    "_megatron_call",
    "finalize_model_grads",
    "get_forward_backward_func",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_megatron_optimizer",
    "get_transformer_layer_offset",
    "model_parallel_cuda_manual_seed",
    "ps",
    "transformer_engine_available",
]


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
