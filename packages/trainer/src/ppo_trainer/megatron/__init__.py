"""The ``megatron`` backend of ppo-trainer (optional extra ``ppo-trainer[megatron]``).

Select it with ``ActorConfig(backend="megatron", backend_options={...})`` (and the same
for the critic); ``backend_options`` is the driver's ``policy.megatron_cfg`` /
``critic.megatron_cfg`` mapping (see :mod:`._options`): ``tensor_model_parallel_size``,
``pipeline_model_parallel_size``, ``optimizer.use_distributed_optimizer``,
``fp8_param`` / ``fp8_recipe``, ``transformer_impl`` (``auto`` / ``transformer_engine`` /
``local``) and ``seed``. ``use_megatron_fsdp`` and MXFP8 parameters with the distributed
optimizer are rejected at set-up with a ``ValueError`` naming the key.

What runs: megatron-core ``GPTModel`` (Transformer Engine layer spec when TE imports
and CUDA is present, the local spec otherwise), megatron DDP (classic, optionally with
the distributed optimizer) and ``get_megatron_optimizer`` (Adam), built from the same
Hugging Face Llama / Qwen2 weights as the torch backend (:mod:`._convert`). The critic
is the same ``GPTModel`` with a scalar value head in place of the output layer.
Without CUDA it runs on the CPU with gloo through the shims of :mod:`._cpu_shim`.

Importing this package imports megatron-core; ``ppo_trainer.get_backend("megatron")``
raises ``ImportError`` naming the extra when it is missing.
"""

from ppo_trainer.megatron._backend import (
    MegatronBackend,
    MegatronFrozenModel,
    MegatronTrainModel,
    create_backend,
    transformer_engine_available,
)
from ppo_trainer.megatron._convert import Layout, hf_to_megatron, megatron_to_hf
from ppo_trainer.megatron._cpu_shim import cuda_as_cpu
from ppo_trainer.megatron._options import MegatronOptions, parse_options
from ppo_trainer.megatron._support import MODEL_FAMILY, model_config_problems

__all__ = [
    "MODEL_FAMILY",
    "Layout",
    "MegatronBackend",
    "MegatronFrozenModel",
    "MegatronOptions",
    "MegatronTrainModel",
    "create_backend",
    "cuda_as_cpu",
    "hf_to_megatron",
    "megatron_to_hf",
    "model_config_problems",
    "parse_options",
    "transformer_engine_available",
]
