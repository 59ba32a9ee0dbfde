"""The mapping to the packages' configs: a :class:`DriverConfig` -> ``ppo_trainer``'s
``ActorConfig`` / ``CriticConfig``, ``ppo_sampler.SamplerConfig``, ``ppo_placement.Layout``,
and the tables that name each package field by its YAML key when the package refuses it
(the packages' ``problems`` are data: no error text is parsed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ppo_placement import (
    Layout,
    LayoutProblem,
    check_streaming_layout,
    layout_problems,
    placement_layout,
    streaming_layout_problems,
)
from ppo_sampler import SamplerConfig, SamplerProblem, fixed_chunk_sizes
from ppo_trainer import ActorConfig, CriticConfig, MegatronProblem, ModelSpec, TrainerProblem

from ppo_driver.config.problems import ValidationReport
from ppo_driver.config.schema import DriverConfig, MegatronCfg, Role

ROLES: tuple[Role, Role] = ("policy", "critic")

MEGATRON_EXTRA = "ppo-trainer[megatron]"

# YAML key of each package field (the packages name fields their own way): the one
# table both for building the package's config and for naming a field it refuses. A
# field missing from its table is one YAML cannot set; it is reported as ``<section>.<field>``.
SAMPLER_KEYS = {
    "num_prompts_per_step": "ppo.num_prompts_per_step",
    "min_groups_for_streaming_train": "async_rl.min_groups_for_streaming_train",
    "deterministic_chunks": "async_rl.deterministic_chunks",
    **{
        name: f"async_rl.sampler.{name}"
        for name in ("name", "max_lookahead_versions", "max_staleness_versions", "evict_stale")
    },
}

LAYOUT_KEYS = {name: f"cluster.{name}" for name in ("actor_gpus", "rollout_gpus", "colocate")}

# Fixes in YAML terms where the package's own names parameters YAML does not have.
LAYOUT_FIXES = {
    "cluster.actor_gpus": "set cluster.actor_gpus to at least 1 (actor and critic share them)",
    "cluster.rollout_gpus": "set cluster.rollout_gpus to at least 1 (the generation engines' "
    "GPUs; with cluster.colocate=true, full-batch mode only, they time-share the training GPUs)",
}

# ppo_trainer's field -> the model section's key (ModelSpec, then ActorConfig/CriticConfig)
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
_MODEL_FIELDS = {name: name for name in (*_SIZE_FIELDS, "dtype")}  # dtype: a model_path's too
_TRAIN_FIELDS = {
    **{name: name for name in ("lr", "weight_decay", "max_grad_norm", "warmup_steps")},
    **{"micro_batch_size": "train_micro_batch_size", "offload_backend": "offload_backend"},
}
# ppo_trainer's field -> the ``ppo`` key of the same name, per model
_PPO_FIELDS = {
    "policy": ("loss_agg", "eps_clip", "eps_clip_high", "dual_clip", "kl_loss_coef",
               "kl_estimator", "entropy_coef"),
    "critic": ("loss_agg", "value_clip"),
}  # fmt: skip


def _section(role: Role) -> str:
    return "critic" if role == "critic" else "policy"


def trainer_keys(role: Role) -> dict[str, str]:
    """YAML key of each ``ModelSpec`` / ``ActorConfig`` / ``CriticConfig`` field of ``role``."""
    section = _section(role)
    keys = {field: f"{section}.{name}" for field, name in (_MODEL_FIELDS | _TRAIN_FIELDS).items()}
    return keys | {name: f"ppo.{name}" for name in _PPO_FIELDS[section]}


def _values(cfg: DriverConfig, keys: Mapping[str, str]) -> dict[str, Any]:
    """``{field: the value at its YAML key}`` for each field of ``keys``."""
    out = {}
    for field, key in keys.items():
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out[field] = node
    return out


def model_path(cfg: DriverConfig, role: Role) -> str | None:
    """The Hugging Face model directory ``role``'s model is built from, made absolute
    (Ray workers on any node read it): its section's ``model_path``; a null
    ``critic.model_path`` takes the policy's (the critic is then the policy's checkpoint
    with a value head on top). None: the tiny Qwen2 of the section's sizes."""
    path = cfg.model(role).model_path
    if path is None and role == "critic":
        path = cfg.policy.model_path
    return None if path is None else str(Path(path).expanduser().absolute())


def _backend_options(mc: MegatronCfg) -> dict[str, Any]:
    """The trainer's ``backend_options``: the ``megatron_cfg`` mapping that
    ``ppo_trainer.megatron.parse_options`` reads (nested ``optimizer``), ``{}`` with torch."""
    if not mc.enabled:
        return {}
    return {name: value for name, value in dataclasses.asdict(mc).items() if name != "enabled"}


def _trainer_kwargs(
    cfg: DriverConfig, role: Role, *, vocab_size: int, samples_per_rank: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of ``role``'s ``ModelSpec`` and of its ``ActorConfig`` /
    ``CriticConfig`` (without ``model``): what ``train`` builds and ``validate`` checks."""
    section = _section(role)
    m, keys = cfg.model(role), trainer_keys(role)
    spec = {
        **_values(cfg, {f: keys[f] for f in _MODEL_FIELDS}),
        "path": model_path(cfg, role),
        "vocab_size": vocab_size,
        "seed": cfg.run.seed + (1 if section == "critic" else 0),  # the critic's differs
    }
    train = _values(cfg, {f: k for f, k in keys.items() if f not in _MODEL_FIELDS})
    # null: one data-parallel rank's share of a fixed block (deterministic chunks while
    # streaming) or of the whole step. An explicit value goes through as it is (0 must
    # reach the trainer's check, not become null).
    if train["micro_batch_size"] is None:
        train["micro_batch_size"] = _block_rows(cfg, samples_per_rank) or samples_per_rank
    backend = {"backend": "megatron" if m.megatron_cfg.enabled else "torch", "device": "auto"}
    return spec, {**train, **backend, "backend_options": _backend_options(m.megatron_cfg)}


def trainer_configs(cfg: DriverConfig, *, vocab_size: int) -> tuple[ActorConfig, CriticConfig]:
    """The ``ppo_trainer.ActorConfig`` and ``CriticConfig`` of this run.

    ``vocab_size`` is the tokenizer's (the tiny model's vocabulary; a ``model_path``
    checkpoint brings its own). The Megatron backend gets ``backend_options`` =
    the ``megatron_cfg`` section (:func:`ppo_trainer.megatron.parse_options` reads it);
    a null ``train_micro_batch_size`` becomes one data-parallel rank's share of the step
    (``samples_per_step / dp_size``). :func:`validate` builds these same objects and
    reports their errors by YAML key; here they raise ``ValueError``.
    """
    kw = {
        role: _trainer_kwargs(
            cfg, role, vocab_size=vocab_size, samples_per_rank=_samples_per_rank(cfg, role)
        )
        for role in ROLES
    }
    actor = ActorConfig(model=ModelSpec(**kw["policy"][0]), **kw["policy"][1])
    critic = CriticConfig(model=ModelSpec(**kw["critic"][0]), **kw["critic"][1])
    return actor, critic


def _block_rows(cfg: DriverConfig, samples_per_rank: int) -> int | None:
    """Rows of one data-parallel rank in each fixed block but the last (which may take
    more) of ``async_rl.deterministic_chunks`` while streaming; None otherwise, or when
    the batch, minimum or alignment is broken (``validate`` reports those)."""
    if not (cfg.fixed_chunks and _streams(cfg)):
        return None
    try:
        batch, alignment = cfg.batch_groups, cfg.group_alignment
        block = fixed_chunk_sizes(batch=batch, min_groups=cfg.min_groups, alignment=alignment)[0]
    except ValueError:
        return None
    rows = samples_per_rank * block // batch
    return rows if rows >= 1 and rows * batch == samples_per_rank * block else None


def _samples_per_rank(cfg: DriverConfig, role: Role, *, guess: bool = False) -> int:
    """Samples of one step on one data-parallel rank of ``role``; ``guess``: with a broken
    mesh (reported by ``_check_mesh``) as if ``tp = pp = 1``, so the other checks run."""
    try:
        dp = cfg.dp_size(role)
    except ValueError:
        if not guess:
            raise
        dp = max(1, cfg.cluster.actor_gpus)
    return max(1, cfg.samples_per_step // dp)


def _sampler_values(cfg: DriverConfig) -> dict[str, Any]:
    """``SamplerConfig``'s keyword arguments, ``deterministic_chunks`` resolved (null:
    :attr:`DriverConfig.fixed_chunks`)."""
    return {**_values(cfg, SAMPLER_KEYS), "deterministic_chunks": cfg.fixed_chunks}


def sampler_config(cfg: DriverConfig) -> SamplerConfig:
    """The ``ppo_sampler.SamplerConfig`` of this run (``ValueError`` naming the key)."""
    return SamplerConfig(**_sampler_values(cfg))


def cluster_layout(cfg: DriverConfig) -> Layout:
    """The ``ppo_placement.Layout`` ``train`` reserves (critic on the actor's bundles),
    checked by ``check_streaming_layout`` when streaming. ``ValueError`` if refused."""
    layout = placement_layout(**_values(cfg, LAYOUT_KEYS))
    check_streaming_layout(layout, streaming=cfg.streaming)
    return layout


def _streams(cfg: DriverConfig) -> bool:
    """Streaming, judged only when the batch and minimum are usable."""
    return 1 <= cfg.min_groups < cfg.batch_groups


# What every package's problem record carries: its own field name, the value, the
# message and the fix (MegatronProblem: a severity too).
_PackageProblem = SamplerProblem | LayoutProblem | TrainerProblem | MegatronProblem


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
        fix = (fixes or {}).get(key, p.fix)
        if isinstance(p, MegatronProblem) and p.severity == "warning":
            if all(q.key != key for q in r.warnings):
                r.warn(key, p.value, p.message, fix)
        elif not r.refused(key):
            r.error(key, p.value, who.format(p.message), fix)


def _check_sampler(r: ValidationReport, cfg: DriverConfig) -> None:
    """``ppo_sampler.SamplerConfig``: the batch, the readiness minimum, the sampler."""
    problems = SamplerConfig.problems(**_sampler_values(cfg))
    _report(
        r, "ppo_sampler.SamplerConfig refuses it ({})", problems, SAMPLER_KEYS, "async_rl.sampler"
    )


def _check_trainer(r: ValidationReport, cfg: DriverConfig) -> None:
    """``ppo_trainer``'s ``ModelSpec``, ``ActorConfig`` and ``CriticConfig``: the very
    fields ``train`` builds them from (:func:`trainer_configs`), problems by YAML key."""
    vocab = _builtin_vocab_size()
    for role in ROLES:
        cls = CriticConfig if role == "critic" else ActorConfig
        per_rank = _samples_per_rank(cfg, role, guess=True)
        spec, kwargs = _trainer_kwargs(cfg, role, vocab_size=vocab, samples_per_rank=per_rank)
        keys, section = trainer_keys(role), _section(role)
        who = "ppo_trainer.{} refuses it ({{}})"
        _report(r, who.format("ModelSpec"), ModelSpec.problems(**spec), keys, section)
        _report(r, who.format(cls.__name__), cls.problems(**kwargs), keys, section)


def _builtin_vocab_size() -> int:
    """The vocabulary ``train`` gives the tiny model (the built-in task's tokenizer)."""
    from ppo_driver.rollout import TASK_ALPHABET, CharTokenizer  # lazy: loads the engines

    return CharTokenizer(TASK_ALPHABET).vocab_size


def _check_layout(r: ValidationReport, cfg: DriverConfig) -> None:
    """The bundle layout ``train`` reserves, as ppo_placement judges it; streaming needs
    generation on its own devices (``streaming_layout_problems``)."""
    kwargs = _values(cfg, LAYOUT_KEYS)
    problems = layout_problems(**kwargs)
    who = "ppo_placement.placement_layout refuses it ({})"
    _report(r, who, problems, LAYOUT_KEYS, "cluster", LAYOUT_FIXES)
    if problems:
        return
    for p in streaming_layout_problems(placement_layout(**kwargs), streaming=_streams(cfg)):
        r.error(
            LAYOUT_KEYS[p.field],
            cfg.cluster.colocate,
            f"streaming is on (async_rl.min_groups_for_streaming_train={cfg.min_groups} < "
            f"ppo.num_prompts_per_step={cfg.batch_groups}); streaming needs generation on its "
            "own devices (ppo_placement.check_streaming_layout refuses a colocated layout: "
            f"{p.message})",
            "set cluster.colocate=false and cluster.rollout_gpus >= 1, "
            f"or async_rl.min_groups_for_streaming_train={cfg.batch_groups} for full-batch mode",
        )
