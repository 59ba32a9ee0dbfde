"""Typed driver configuration: YAML plus dotted overrides, and start-up validation.

The key names (``ppo.*``, ``async_rl.*``, ``policy.megatron_cfg.*``) follow the
project's streaming design document (``colocated-ppo-streaming.md``, not shipped).
Every unknown key, wrong type and broken rule is collected, each naming the key, the
value and the fix, so ``ppo-driver validate`` reports them all.

:mod:`.schema` (the sections and their declared ranges), :mod:`.loading` (YAML and
overrides), :mod:`.problems` (the report, :class:`ValidConfig`), :mod:`.packages` (one
table per package from its fields to YAML keys: :func:`trainer_configs`,
:func:`sampler_config`, :func:`cluster_layout`, and the packages' problems by key),
:mod:`.rules` (the rules across packages), :mod:`.megatron`, :mod:`.preflight` (the
workload against the models) and :mod:`.validation`. The rules of the engines, the
workload, the model directories and the machine live with what they govern."""

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
