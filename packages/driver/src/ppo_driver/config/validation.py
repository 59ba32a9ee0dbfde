""":func:`validate`: every check, all problems at once; :func:`validated`, the door
to ``train``.
"""

from __future__ import annotations

import copy

from ppo_driver import _machine_rules
from ppo_driver.config.megatron import _check_megatron
from ppo_driver.config.packages import _check_layout, _check_sampler, _check_trainer
from ppo_driver.config.preflight import _check_files
from ppo_driver.config.problems import ValidationReport, ValidConfig
from ppo_driver.config.rules import (
    _check_alignment,
    _check_block_order,
    _check_colocated_lookahead,
    _check_dtype,
    _check_fields,
    _check_rules,
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
    """Every value the trainer, the sampler, the placement or the engines would refuse,
    and every rule across them; all problems at once, before Ray starts; never raises.

    Each package's own rules are asked, as data, with the values ``train`` builds its
    configs from, and each refused field is reported under the YAML key the tables
    (:data:`SAMPLER_KEYS`, :func:`trainer_keys`, :data:`LAYOUT_KEYS`) map it to. The
    engines, the workload, the model directories and the machine state their own rules
    (``rollout._engine_rules``, ``workload``, ``_model_rules``, ``_machine_rules``).
    """
    from ppo_driver.rollout._engine_rules import engine_problems  # lazy: loads the engines

    r = ValidationReport(judged=copy.deepcopy(cfg))
    _check_fields(r, cfg)
    _check_sampler(r, cfg)
    _check_rules(r, cfg)
    _check_trainer(r, cfg)
    r.add(_machine_rules.offload_problems(cfg, refused={p.key for p in r.errors}))
    _check_dtype(r, cfg)
    mesh_ok = _check_megatron(r, cfg)
    _check_layout(r, cfg)
    _check_colocated_lookahead(r, cfg)
    _check_block_order(r, cfg)
    if mesh_ok:
        _check_alignment(r, cfg)
    _check_files(r, cfg)
    r.add(_machine_rules.cluster_problems(cfg))
    r.add(engine_problems(cfg))
    r.add(_machine_rules.tensorboard_problems(cfg))
    return r
