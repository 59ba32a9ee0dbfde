"""The mapping to the packages' configs: a :class:`DriverConfig` -> ``ppo_trainer``'s
``ActorConfig`` / ``CriticConfig``, ``ppo_sampler.SamplerConfig``, ``ppo_placement.Layout``,
and the tables that name each package field by its YAML key when the package refuses it
(the packages' ``problems`` are data: no error text is parsed).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ppo_placement import (
    Layout,
    check_streaming_layout,
    layout_problems,
    placement_layout,
    streaming_layout_problems,
)
from ppo_sampler import SamplerConfig
from ppo_trainer import (
    ActorConfig,
    CriticConfig,
    ModelSpec,
)

from ppo_driver.config.problems import ConfigProblem, ValidationReport
from ppo_driver.config.schema import DriverConfig, MegatronCfg, ModelConfig, Role

ROLES: tuple[Role, Role] = ("policy", "critic")


MEGATRON_EXTRA = "ppo-trainer[megatron]"


# Fields of ppo_trainer's configs and the driver keys they come from.
_TRAIN_FIELDS = {
    "lr": "lr",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "warmup_steps": "warmup_steps",
    "micro_batch_size": "train_micro_batch_size",
    "offload_backend": "offload_backend",
}


_ACTOR_PPO_FIELDS = (
    "eps_clip",
    "eps_clip_high",
    "dual_clip",
    "kl_loss_coef",
    "kl_estimator",
    "entropy_coef",
)


_CRITIC_PPO_FIELDS = ("value_clip",)


_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


_MODEL_FIELDS = (*_SIZE_FIELDS, "dtype")  # dtype applies to a model_path's weights too


def _section(role: Role) -> str:
    return "critic" if role == "critic" else "policy"


def model_path(cfg: DriverConfig, role: Role) -> str | None:
    """The Hugging Face model directory ``role``'s model is built from, made absolute
    (Ray workers on any node read it): its section's ``model_path``; a null
    ``critic.model_path`` takes the policy's (the critic is then the policy's checkpoint
    with a value head on top). None: the tiny Qwen2 of the section's sizes."""
    path = cfg.model(role).model_path
    if path is None and role == "critic":
        path = cfg.policy.model_path
    return None if path is None else str(Path(path).expanduser().absolute())


def _seed(cfg: DriverConfig, role: Role) -> int:
    """The model seed of ``role`` (the critic's differs from the policy's)."""
    return cfg.run.seed + (1 if role == "critic" else 0)


def _model_spec_kwargs(m: ModelConfig, *, vocab_size: int, seed: int) -> dict[str, Any]:
    """``ppo_trainer.ModelSpec`` keyword arguments of one model section."""
    return {
        "path": m.model_path,
        "vocab_size": vocab_size,
        **{name: getattr(m, name) for name in _MODEL_FIELDS},
        "seed": seed,
    }


def _backend_options(mc: MegatronCfg) -> dict[str, Any]:
    """The trainer's ``backend_options``: the ``megatron_cfg`` mapping that
    ``ppo_trainer.megatron.parse_options`` reads (nested ``optimizer``), ``{}`` with torch."""
    if not mc.enabled:
        return {}
    return {
        "tensor_model_parallel_size": mc.tensor_model_parallel_size,
        "pipeline_model_parallel_size": mc.pipeline_model_parallel_size,
        "use_megatron_fsdp": mc.use_megatron_fsdp,
        "fp8_param": mc.fp8_param,
        "fp8_recipe": mc.fp8_recipe,
        "transformer_impl": mc.transformer_impl,
        "optimizer": dataclasses.asdict(mc.optimizer),
    }


def _train_kwargs(cfg: DriverConfig, role: Role, *, samples_per_rank: int) -> dict[str, Any]:
    """The fields ``ActorConfig`` and ``CriticConfig`` share, for ``role`` (no model)."""
    m = cfg.model(role)
    micro = m.train_micro_batch_size
    return {
        "backend": "megatron" if m.megatron_cfg.enabled else "torch",
        "backend_options": _backend_options(m.megatron_cfg),
        "device": "auto",
        "lr": m.lr,
        "weight_decay": m.weight_decay,
        "max_grad_norm": m.max_grad_norm,
        "warmup_steps": m.warmup_steps,
        # null: the whole step of one data-parallel rank in one micro-batch. An explicit
        # value goes through as it is (0 must reach the trainer's check, not become null).
        "micro_batch_size": samples_per_rank if micro is None else micro,
        "loss_agg": cfg.ppo.loss_agg,
        "offload_backend": m.offload_backend,
    }


def _actor_kwargs(cfg: DriverConfig, *, samples_per_rank: int) -> dict[str, Any]:
    ppo = cfg.ppo
    return {
        **_train_kwargs(cfg, "policy", samples_per_rank=samples_per_rank),
        **{name: getattr(ppo, name) for name in _ACTOR_PPO_FIELDS},
    }


def _critic_kwargs(cfg: DriverConfig, *, samples_per_rank: int) -> dict[str, Any]:
    return {
        **_train_kwargs(cfg, "critic", samples_per_rank=samples_per_rank),
        **{name: getattr(cfg.ppo, name) for name in _CRITIC_PPO_FIELDS},
    }


def trainer_configs(cfg: DriverConfig, *, vocab_size: int) -> tuple[ActorConfig, CriticConfig]:
    """The ``ppo_trainer.ActorConfig`` and ``CriticConfig`` of this run.

    ``vocab_size`` is the tokenizer's (the tiny model's vocabulary; a ``model_path``
    checkpoint brings its own). The Megatron backend gets ``backend_options`` =
    the ``megatron_cfg`` section (:func:`ppo_trainer.megatron.parse_options` reads it);
    a null ``train_micro_batch_size`` becomes one data-parallel rank's share of the step
    (``samples_per_step / dp_size``). :func:`validate` builds these same objects and
    reports their errors by YAML key; here they raise ``ValueError``.
    """
    models = {
        role: ModelSpec(
            **{
                **_model_spec_kwargs(cfg.model(role), vocab_size=vocab_size, seed=_seed(cfg, role)),
                "path": model_path(cfg, role),
            }
        )
        for role in ROLES
    }
    actor = ActorConfig(
        model=models["policy"],
        **_actor_kwargs(cfg, samples_per_rank=_samples_per_rank(cfg, "policy")),
    )
    critic = CriticConfig(
        model=models["critic"],
        **_critic_kwargs(cfg, samples_per_rank=_samples_per_rank(cfg, "critic")),
    )
    return actor, critic


def _samples_per_rank(cfg: DriverConfig, role: Role) -> int:
    """Samples of one step on one data-parallel rank of ``role``."""
    return max(1, cfg.samples_per_step // cfg.dp_size(role))


def _sampler_kwargs(cfg: DriverConfig) -> dict[str, Any]:
    s = cfg.async_rl.sampler
    return {
        "num_prompts_per_step": cfg.batch_groups,
        "min_groups_for_streaming_train": cfg.min_groups,
        "name": s.name,
        "max_lookahead_versions": s.max_lookahead_versions,
        "max_staleness_versions": s.max_staleness_versions,
        "evict_stale": s.evict_stale,
        "deterministic_chunks": cfg.async_rl.deterministic_chunks,
    }


def sampler_config(cfg: DriverConfig) -> SamplerConfig:
    """The ``ppo_sampler.SamplerConfig`` of this run (``ValueError`` naming the key)."""
    return SamplerConfig(**_sampler_kwargs(cfg))


def _layout_kwargs(cfg: DriverConfig) -> dict[str, Any]:
    c = cfg.cluster
    return {"actor_gpus": c.actor_gpus, "rollout_gpus": c.rollout_gpus, "colocate": c.colocate}


def cluster_layout(cfg: DriverConfig) -> Layout:
    """The ``ppo_placement.Layout`` ``train`` reserves (critic on the actor's bundles),
    checked by ``check_streaming_layout`` when streaming. ``ValueError`` if refused."""
    layout = placement_layout(**_layout_kwargs(cfg))
    check_streaming_layout(layout, streaming=cfg.streaming)
    return layout


def _streaming_why(cfg: DriverConfig) -> str:
    return (
        f"streaming is on (async_rl.min_groups_for_streaming_train={cfg.min_groups} < "
        f"ppo.num_prompts_per_step={cfg.batch_groups})"
    )


def _streams(cfg: DriverConfig) -> bool:
    """Streaming, judged only when the batch and minimum are usable."""
    return 1 <= cfg.min_groups < cfg.batch_groups


class _PackageProblem(typing.Protocol):
    """What every package's problem record carries (``SamplerProblem``,
    ``LayoutProblem``, ``TrainerProblem``, ``MegatronProblem``): the package's own field
    name, the value, what is wrong and the fix."""

    @property
    def field(self) -> str: ...
    @property
    def value(self) -> object: ...
    @property
    def message(self) -> str: ...
    @property
    def fix(self) -> str: ...


# YAML key of each package field (the packages name fields their own way). A field
# missing from its table is one YAML cannot set; it is reported under ``<section>.<field>``.
SAMPLER_KEYS = {
    "num_prompts_per_step": "ppo.num_prompts_per_step",
    "min_groups_for_streaming_train": "async_rl.min_groups_for_streaming_train",
    "name": "async_rl.sampler.name",
    "max_lookahead_versions": "async_rl.sampler.max_lookahead_versions",
    "max_staleness_versions": "async_rl.sampler.max_staleness_versions",
    "evict_stale": "async_rl.sampler.evict_stale",
    "deterministic_chunks": "async_rl.deterministic_chunks",
}


LAYOUT_KEYS = {name: f"cluster.{name}" for name in ("actor_gpus", "rollout_gpus", "colocate")}


# Fixes in YAML terms where the package's own names parameters YAML does not have.
_GPUS_FIX = "set cluster.{0} to at least 1 ({1})"


LAYOUT_FIXES = {
    "cluster.actor_gpus": _GPUS_FIX.format("actor_gpus", "actor and critic share them"),
    "cluster.rollout_gpus": _GPUS_FIX.format(
        "rollout_gpus",
        "the generation engines' GPUs; with cluster.colocate=true, full-batch mode "
        "only, they time-share the training GPUs",
    ),
}


def trainer_keys(role: Role) -> dict[str, str]:
    """YAML key of each ``ModelSpec`` / ``ActorConfig`` / ``CriticConfig`` field of ``role``."""
    section = _section(role)
    keys = {name: f"{section}.{name}" for name in _MODEL_FIELDS}
    keys |= {field: f"{section}.{name}" for field, name in _TRAIN_FIELDS.items()}
    ppo = _ACTOR_PPO_FIELDS if role != "critic" else _CRITIC_PPO_FIELDS
    keys |= {name: f"ppo.{name}" for name in ("loss_agg", *ppo)}
    return keys


def _report(
    r: ValidationReport,
    who: str,
    problems: Iterable[_PackageProblem],
    keys: Mapping[str, str],
    section: str,
    fixes: Mapping[str, str] | None = None,
) -> None:
    """Each package problem under the YAML key ``keys`` maps its field to (``who``: the
    error's wording, ``{}`` the package's message); a key reported already (non-finite,
    or a ``ppo`` key refused by both models) is not repeated."""
    for p in problems:
        key = keys.get(p.field, f"{section}.{p.field}")
        warning = getattr(p, "severity", "error") == "warning"
        into = r.warnings if warning else r.errors
        if any(q.key == key for q in into):
            continue
        fix = (fixes or {}).get(key, p.fix)
        into.append(
            ConfigProblem(key, p.value, who.format(p.message), fix)
            if not warning
            else ConfigProblem(key, p.value, p.message, fix, severity="warning")
        )


def _check_sampler(r: ValidationReport, cfg: DriverConfig) -> None:
    """``ppo_sampler.SamplerConfig``: the batch, the readiness minimum, the sampler."""
    problems = SamplerConfig.problems(**_sampler_kwargs(cfg))
    _report(
        r, "ppo_sampler.SamplerConfig refuses it ({})", problems, SAMPLER_KEYS, "async_rl.sampler"
    )


def _check_trainer(r: ValidationReport, cfg: DriverConfig) -> None:
    """``ppo_trainer``'s ``ModelSpec``, ``ActorConfig`` and ``CriticConfig``: the very
    fields ``train`` builds them from (:func:`trainer_configs`), problems by YAML key."""
    vocab = _builtin_vocab_size()
    for role in ROLES:
        keys, section = trainer_keys(role), _section(role)
        spec = _model_spec_kwargs(cfg.model(role), vocab_size=vocab, seed=_seed(cfg, role))
        spec["path"] = model_path(cfg, role)
        _report(
            r, "ppo_trainer.ModelSpec refuses it ({})", ModelSpec.problems(**spec), keys, section
        )
        per_rank = _samples_per_rank_or_guess(cfg, role)
        if role == "critic":
            problems = CriticConfig.problems(**_critic_kwargs(cfg, samples_per_rank=per_rank))
        else:
            problems = ActorConfig.problems(**_actor_kwargs(cfg, samples_per_rank=per_rank))
        who = (
            f"ppo_trainer.{'CriticConfig' if role == 'critic' else 'ActorConfig'} refuses it ({{}})"
        )
        _report(r, who, problems, keys, section)


def _samples_per_rank_or_guess(cfg: DriverConfig, role: Role) -> int:
    """:func:`_samples_per_rank`; a guess when the mesh is broken (``_check_mesh``
    reports that), so that the trainer's other checks still run."""
    try:
        return _samples_per_rank(cfg, role)
    except ValueError:
        return max(1, cfg.samples_per_step // max(1, cfg.cluster.actor_gpus))


def _builtin_vocab_size() -> int:
    """The vocabulary ``train`` gives the tiny model (the built-in task's tokenizer)."""
    from ppo_driver.rollout import TASK_ALPHABET, CharTokenizer  # lazy: loads the engines

    return CharTokenizer(TASK_ALPHABET).vocab_size


def _check_layout(r: ValidationReport, cfg: DriverConfig) -> None:
    """The bundle layout ``train`` reserves, as ppo_placement judges it; streaming needs
    generation on its own devices (``streaming_layout_problems``)."""
    kwargs = _layout_kwargs(cfg)
    problems = layout_problems(**kwargs)
    _report(
        r,
        "ppo_placement.placement_layout refuses it ({})",
        problems,
        LAYOUT_KEYS,
        "cluster",
        LAYOUT_FIXES,
    )
    if problems:
        return
    for p in streaming_layout_problems(placement_layout(**kwargs), streaming=_streams(cfg)):
        r.errors.append(
            ConfigProblem(
                LAYOUT_KEYS[p.field],
                cfg.cluster.colocate,
                f"{_streaming_why(cfg)}; streaming needs generation on its own devices "
                f"(ppo_placement.check_streaming_layout refuses a colocated layout: {p.message})",
                "set cluster.colocate=false and cluster.rollout_gpus >= 1, "
                f"or async_rl.min_groups_for_streaming_train={cfg.batch_groups} for full-batch mode",
            )
        )
