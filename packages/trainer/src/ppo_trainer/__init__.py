"""ppo_trainer: PPO math, actor and critic workers, pluggable training backends.

Public API (see the package README and docs/interfaces.md):

* math: ``gae`` (pinned), ``policy_loss``, ``value_loss``, ``kl_penalty``,
  ``entropy_from_logits``, ``logprobs_from_logits``, ``masked_mean``, ``masked_sum``,
  ``masked_whiten``, ``masked_moments`` / ``whiten_with`` (``Moments``:
  advantage statistics fixed before a streamed step), ``aggregate_loss``, ``check_reward_kl``, ``MAX_LOG_RATIO``;
* configs: ``ModelSpec``, ``ActorConfig``, ``CriticConfig``;
* workers: ``ActorWorker``, ``CriticWorker``, ``loss_denominator``, ``EmptyStepError``,
  ``Mesh`` (``worker.mesh()``), ``Timeline`` (``worker.last_timeline()``); lifecycle
  parts (``Part``, ``ALL_PARTS``, ``KEEP_GRADIENTS``) come from ``ppo_lifecycle``;
* Hugging Face models: ``build_causal_lm``, ``build_value_model``, ``save_hf_checkpoint``;
* backends: ``get_backend``, ``register_backend``, ``available_backends``,
  ``backend_importable`` and the ``Backend`` / ``TrainModel`` / ``FrozenModel`` protocols;
* offload and communicators: ``resolve_offload_backend`` (what ``offload_backend``
  becomes on a device), ``memory_saver_installed``, ``CommunicatorSuspender`` (NCCL
  communicators released while a process's models sleep).
"""

from ppo_trainer._backend import (
    Backend,
    BackendFactory,
    FrozenModel,
    Mesh,
    TrainModel,
    available_backends,
    backend_importable,
    get_backend,
    lr_multiplier,
    register_backend,
)
from ppo_trainer._config import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LR_SCHEDULERS,
    OFFLOAD_BACKENDS,
    ActorConfig,
    CriticConfig,
    ModelSpec,
    TrainerConfigError,
    TrainerProblem,
    offload_backend_name,
)
from ppo_trainer._math import (
    MAX_LOG_RATIO,
    Moments,
    PolicyLoss,
    ValueLoss,
    aggregate_loss,
    check_reward_kl,
    entropy_from_logits,
    gae,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_whiten,
    policy_loss,
    reward_kl_problem,
    value_loss,
    whiten_with,
)
from ppo_trainer._megatron_rules import (
    FP8_RECIPES,
    MEGATRON_OPTIMIZER_KEYS,
    MEGATRON_OPTION_KEYS,
    TRANSFORMER_IMPLS,
    MegatronConfigError,
    MegatronProblem,
    data_parallel_size,
    mesh_problems,
    option_problems,
)
from ppo_trainer._offload import (
    CommunicatorSuspender,
    memory_saver_installed,
    memory_saver_problem,
    resolve_offload_backend,
)
from ppo_trainer._torch_backend import (
    build_causal_lm,
    build_value_model,
    host_bound_tcp_store,
    save_hf_checkpoint,
)
from ppo_trainer._workers import (
    ActorWorker,
    CriticWorker,
    EmptyStepError,
    Timeline,
    loss_denominator,
)

__version__ = "0.6.0"

__all__ = [
    "FP8_RECIPES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LR_SCHEDULERS",
    "MAX_LOG_RATIO",
    "MEGATRON_OPTIMIZER_KEYS",
    "MEGATRON_OPTION_KEYS",
    "OFFLOAD_BACKENDS",
    "TRANSFORMER_IMPLS",
    "ActorConfig",
    "ActorWorker",
    "Backend",
    "BackendFactory",
    "CommunicatorSuspender",
    "CriticConfig",
    "CriticWorker",
    "EmptyStepError",
    "FrozenModel",
    "MegatronConfigError",
    "MegatronProblem",
    "Mesh",
    "ModelSpec",
    "Moments",
    "PolicyLoss",
    "Timeline",
    "TrainModel",
    "TrainerConfigError",
    "TrainerProblem",
    "ValueLoss",
    "__version__",
    "aggregate_loss",
    "available_backends",
    "backend_importable",
    "build_causal_lm",
    "build_value_model",
    "check_reward_kl",
    "data_parallel_size",
    "entropy_from_logits",
    "gae",
    "get_backend",
    "host_bound_tcp_store",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominator",
    "lr_multiplier",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_whiten",
    "memory_saver_installed",
    "memory_saver_problem",
    "mesh_problems",
    "offload_backend_name",
    "option_problems",
    "policy_loss",
    "register_backend",
    "resolve_offload_backend",
    "reward_kl_problem",
    "save_hf_checkpoint",
    "value_loss",
    "whiten_with",
]
