""":func:`validate`: every check, all problems at once; :func:`validated`, the door
to ``train``.
"""

from __future__ import annotations

import copy

from ppo_driver.config.engines import (
    _check_cluster_address,
    _check_engine,
    _check_offload_backend,
    _check_tensorboard,
)
from ppo_driver.config.megatron import _check_megatron
from ppo_driver.config.packages import _check_layout, _check_sampler, _check_trainer
from ppo_driver.config.preflight import _check_files, _check_reward
from ppo_driver.config.problems import ValidationReport, ValidConfig, _non_finite_problem
from ppo_driver.config.rules import (
    _check_alignment,
    _check_colocated_lookahead,
    _check_driver_ranges,
    _check_dtype,
    _check_rules,
    _non_finite,
)
from ppo_driver.config.schema import DriverConfig


def validated(cfg: DriverConfig | ValidConfig) -> ValidConfig:
    """``cfg`` validated: a :class:`ValidConfig` as it is, a :class:`DriverConfig` through
    :func:`validate` (:class:`ConfigError` listing every error). The Python API's door:
    ``train(DriverConfig(...))`` gets the same refusals as ``ppo-driver train``."""
    if isinstance(cfg, ValidConfig):
        return cfg
    return validate(cfg).valid()


def validate(cfg: DriverConfig) -> ValidationReport:
    """Every value the trainer, the sampler, the placement or the engines would refuse.

    Asks each package's own rules, as data, with the values ``train`` builds its configs
    from (``ppo_sampler.SamplerConfig.problems``, ``ppo_trainer.ModelSpec`` /
    ``ActorConfig`` / ``CriticConfig.problems``, ``ppo_trainer.option_problems`` and
    ``mesh_problems`` for the Megatron backend, ``ppo_placement.layout_problems``) and
    reports each refused field under the YAML key the tables (:data:`SAMPLER_KEYS`,
    :func:`trainer_keys`, :data:`LAYOUT_KEYS`) map it to. The driver adds the keys no
    package reads and the rules across packages: the streaming rules of the document, one
    layout for both models, group alignment over each model's data-parallel size, the
    optional extras, the model / data files and the reward function (imported here).
    Runs before Ray starts and returns all problems at once; never raises.
    """
    r = ValidationReport(judged=copy.deepcopy(cfg))
    r.errors.extend(_non_finite_problem(key, value) for key, value in _non_finite(cfg))
    _check_driver_ranges(r, cfg)
    _check_sampler(r, cfg)
    _check_rules(r, cfg)
    _check_trainer(r, cfg)
    _check_offload_backend(r, cfg)
    _check_dtype(r, cfg)
    mesh_ok = _check_megatron(r, cfg)
    _check_layout(r, cfg)
    _check_colocated_lookahead(r, cfg)
    if mesh_ok:
        _check_alignment(r, cfg)
    _check_files(r, cfg)
    _check_reward(r, cfg)
    _check_cluster_address(r, cfg)
    _check_engine(r, cfg)
    _check_tensorboard(r, cfg)
    return r
