"""Typed driver configuration: YAML plus dotted overrides, and start-up validation.

The key names follow ``reference/colocated-ppo-streaming.md`` (``ppo.*``, ``async_rl.*``,
``policy.megatron_cfg.*``). Loading never raises on the first problem: every unknown
key, every wrong type and every broken rule is collected, so ``ppo-driver validate``
can report them all at once. Each problem names the key, the value and the fix.

The packages' typed configs are built HERE, once, from a :class:`DriverConfig`:
:func:`trainer_configs` (``ppo_trainer.ActorConfig`` / ``CriticConfig``, with the Megatron
``backend_options``), :func:`sampler_config` (``ppo_sampler.SamplerConfig``) and
:func:`cluster_layout` (``ppo_placement.Layout``). :func:`validate` asks the packages'
``problems`` for the very same field values and maps each refused field to its YAML key
by table; the driver itself only checks the keys no package reads and the rules that
span packages.

One module per concern: :mod:`.schema` (the sections), :mod:`.loading` (YAML and
overrides), :mod:`.problems` (the report), :mod:`.packages` (the mapping to the packages'
configs and their problems by YAML key), :mod:`.rules` (the driver's keys and the rules
across packages), :mod:`.megatron`, :mod:`.preflight` (model files, and the workload
against the models) and :mod:`.validation`. The rules of the engines, the workload and
the machine live with what they govern: ``ppo_driver.rollout._engine_rules``,
``ppo_driver.workload`` and ``ppo_driver._machine_rules``.
"""

from ppo_driver._machine import cuda_device_count, local_num_cpus
from ppo_driver.config.loading import apply_overrides, default_config_path, load_config
from ppo_driver.config.packages import (
    LAYOUT_KEYS,
    ROLES,
    SAMPLER_KEYS,
    cluster_layout,
    model_path,
    sampler_config,
    trainer_configs,
    trainer_keys,
)
from ppo_driver.config.problems import ConfigError, ConfigProblem, ValidationReport, ValidConfig
from ppo_driver.config.schema import (
    ADV_NORMALIZATIONS,
    AdvEstimatorConfig,
    AsyncRLConfig,
    ClusterConfig,
    DriverConfig,
    MegatronCfg,
    MegatronOptimizerCfg,
    ModelConfig,
    PPOConfig,
    Role,
    RolloutConfig,
    RunConfig,
    SamplerCfg,
)
from ppo_driver.config.validation import validate, validated

__all__ = [
    "ADV_NORMALIZATIONS",
    "LAYOUT_KEYS",
    "ROLES",
    "SAMPLER_KEYS",
    "AdvEstimatorConfig",
    "AsyncRLConfig",
    "ClusterConfig",
    "ConfigError",
    "ConfigProblem",
    "DriverConfig",
    "MegatronCfg",
    "MegatronOptimizerCfg",
    "ModelConfig",
    "PPOConfig",
    "Role",
    "RolloutConfig",
    "RunConfig",
    "SamplerCfg",
    "ValidConfig",
    "ValidationReport",
    "apply_overrides",
    "cluster_layout",
    "cuda_device_count",
    "default_config_path",
    "load_config",
    "local_num_cpus",
    "model_path",
    "sampler_config",
    "trainer_configs",
    "trainer_keys",
    "validate",
    "validated",
]
