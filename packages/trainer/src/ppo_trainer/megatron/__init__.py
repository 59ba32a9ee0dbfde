"""The ``megatron`` backend of ppo-trainer (optional extra ``ppo-trainer[megatron]``).

Importing this package imports megatron-core; ``ppo_trainer.get_backend("megatron")``
raises ``ImportError`` naming the extra when it is missing. See ``_backend.py`` for the
backend, ``_convert.py`` for the HF <-> Megatron weight conversion and ``_cpu_shim.py``
for what makes megatron-core run without CUDA.
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

__all__ = [
    "Layout",
    "MegatronBackend",
    "MegatronFrozenModel",
    "MegatronOptions",
    "MegatronTrainModel",
    "create_backend",
    "cuda_as_cpu",
    "hf_to_megatron",
    "megatron_to_hf",
    "parse_options",
    "transformer_engine_available",
]
