"""The Megatron backend in ``validate``: its option and mesh rules as the trainer states
them (``ppo_trainer.option_problems`` / ``mesh_problems``, no megatron import), the
checkpoint family, and what spans both models (one backend, one layout).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_trainer import (
    get_backend,
    mesh_problems,
    option_problems,
)

from ppo_driver.config.packages import (
    MEGATRON_EXTRA,
    ROLES,
    _backend_options,
    _builtin_vocab_size,
    _report,
    model_path,
)
from ppo_driver.config.preflight import _hf_config
from ppo_driver.config.problems import ConfigProblem, ValidationReport
from ppo_driver.config.schema import DriverConfig, MegatronCfg, Role


def _check_megatron(r: ValidationReport, cfg: DriverConfig) -> bool:
    """The Megatron backend: its option parser (with the extra), the rules it leaves to
    set-up (Transformer Engine, FP8 recipes), the mesh, and one backend and layout for
    both models. Returns whether both models' meshes are usable (``dp_size``)."""
    enabled = [role for role in ROLES if cfg.model(role).megatron_cfg.enabled]
    for role in ROLES:
        if role not in enabled:
            _warn_inert_megatron(r, cfg, role)
    if not enabled:
        return True
    why = _megatron_import_error()
    if why is not None:
        p = f"{enabled[0]}.megatron_cfg"
        r.errors.append(
            ConfigProblem(
                f"{p}.enabled",
                True,
                f"the Megatron backend cannot be imported ({why})",
                f"install the extra {MEGATRON_EXTRA} (in this workspace: "
                f"`uv sync --extra megatron`), or set {p}.enabled=false",
            )
        )
    mesh_ok = True
    for role in enabled:
        if why is None:
            _check_megatron_model(r, cfg, role)
        _check_megatron_options(r, cfg, role, te=None if why is not None else _te_available())
        mesh_ok &= _check_mesh(r, cfg, role)
    _check_megatron_pair(r, cfg)
    return mesh_ok


def _check_megatron_model(r: ValidationReport, cfg: DriverConfig, role: Role) -> None:
    """The checkpoint ``role`` is built from is one the megatron backend builds
    (``ppo_trainer.megatron.model_config_problems``: the Llama / Qwen2 family with plain
    RoPE); the built-in tiny model always is."""
    from ppo_trainer.megatron import MODEL_FAMILY, model_config_problems  # lazy: the extra

    source = model_path(cfg, role)
    if source is None:
        return
    key = f"{role}.model_path" if cfg.model(role).model_path is not None else "policy.model_path"
    try:
        hf_config = _hf_config(source)
    except Exception:  # reported by _check_model_dirs
        return
    problems = model_config_problems(hf_config)
    if problems:
        r.errors.append(
            ConfigProblem(
                key,
                source,
                f"the {role}'s model cannot be built by the megatron backend: "
                f"{'; '.join(problems)}",
                f"use a {'/'.join(MODEL_FAMILY)} model with plain RoPE, or set "
                f"{role}.megatron_cfg.enabled=false (the torch backend builds any causal LM)",
            )
        )


def _megatron_import_error() -> str | None:
    """Why the trainer's Megatron backend cannot be imported here (None: it can)."""
    try:
        get_backend("megatron")
    except ImportError as exc:
        return str(exc).splitlines()[0]
    return None


def _warn_inert_megatron(r: ValidationReport, cfg: DriverConfig, role: Role) -> None:
    """``megatron_cfg`` settings of a model that trains with plain torch do nothing."""
    p = f"{role}.megatron_cfg"
    mine = _leaves(dataclasses.asdict(cfg.model(role).megatron_cfg))
    for name, default in _leaves(dataclasses.asdict(MegatronCfg())).items():
        if name != "enabled" and mine[name] != default:
            r.warnings.append(
                ConfigProblem(
                    f"{p}.{name}",
                    mine[name],
                    f"has no effect while {p}.enabled is false (the model trains with plain torch)",
                    f"set {p}.enabled=true to use it, or remove {p}.{name}",
                    severity="warning",
                )
            )


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_megatron_pair(r: ValidationReport, cfg: DriverConfig) -> None:
    """Actor and critic: one backend, one parallel layout (critic rank r runs on actor
    rank r's bundle and hands it its values)."""
    policy, critic = cfg.policy.megatron_cfg, cfg.critic.megatron_cfg
    if policy.enabled != critic.enabled:
        r.errors.append(
            ConfigProblem(
                "critic.megatron_cfg.enabled",
                critic.enabled,
                "actor and critic must use the same backend and parallel layout (they share ranks)",
                f"set critic.megatron_cfg.enabled={str(policy.enabled).lower()}",
            )
        )
        return
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        mine, theirs = getattr(critic, name), getattr(policy, name)
        key = f"critic.megatron_cfg.{name}"
        if mine != theirs and min(mine, theirs) >= 1 and all(p.key != key for p in r.errors):
            r.errors.append(
                ConfigProblem(
                    key,
                    mine,
                    f"actor and critic must use the same parallel layout (policy has "
                    f"{theirs}): the critic reuses the actor's placement bundles, critic "
                    "rank r runs beside actor rank r and hands it its values",
                    f"set critic.megatron_cfg.{name}={theirs}",
                )
            )


def _te_available() -> bool:
    from ppo_trainer.megatron import transformer_engine_available  # lazy: the extra

    return transformer_engine_available()


def _check_megatron_options(
    r: ValidationReport, cfg: DriverConfig, role: Role, *, te: bool | None
) -> None:
    """``ppo_trainer.option_problems`` (the rules ``parse_options`` and the backend's
    set-up apply) on the ``backend_options`` ``train`` passes; ``te``: whether Transformer
    Engine is usable here (None: the extra is missing, reported already)."""
    p = f"{role}.megatron_cfg"
    options = _backend_options(cfg.model(role).megatron_cfg)
    problems = option_problems(options, prefix=p, te_available=te)
    _report(
        r,
        "not supported by the Megatron backend: {} (ppo_trainer.option_problems)",
        problems,
        {},
        p,
    )


@dataclass(frozen=True)
class _Shape:
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    source: str


def _model_shape(cfg: DriverConfig, role: Role) -> _Shape | None:
    """The head / layer / vocabulary counts the trainer builds ``role`` with: the
    checkpoint's config.json with a model_path, else the tiny model of the config."""
    m = cfg.model(role)
    source = model_path(cfg, role)  # the critic's defaults to the policy's
    if source is None:
        if min(m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers) < 1:
            return None  # reported by ppo_trainer.ModelSpec
        return _Shape(
            m.num_attention_heads,
            m.num_key_value_heads,
            m.num_hidden_layers,
            _builtin_vocab_size(),
            f"the {role}.* model sizes and the built-in task's vocabulary",
        )
    path = Path(source) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
        heads = int(hf["num_attention_heads"])
        return _Shape(
            heads,
            int(hf.get("num_key_value_heads") or heads),
            int(hf["num_hidden_layers"]),
            int(hf["vocab_size"]),
            str(path),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # reported by _check_files


def _check_mesh(r: ValidationReport, cfg: DriverConfig, role: Role) -> bool:
    """The model's ranks as the shared placement holds them (one per training GPU,
    ``cluster.actor_gpus``): ``tp * pp`` must divide them (the rest is data parallel),
    ``tp`` the heads, key/value heads and vocabulary, ``pp`` the layers (what megatron's
    parallel_state and the trainer's transformer config refuse at set-up). Returns
    whether ``dp_size(role)`` is defined."""
    p = f"{role}.megatron_cfg"
    tp, pp = cfg.model_parallel_sizes(role)
    gpus = cfg.cluster.actor_gpus
    shape = _model_shape(cfg, role) if min(tp, pp) >= 1 else None
    problems = mesh_problems(
        world_size=gpus,
        tp=tp,
        pp=pp,
        heads=None if shape is None else shape.heads,
        kv_heads=None if shape is None else shape.kv_heads,
        vocab=None if shape is None else shape.vocab,
        layers=None if shape is None else shape.layers,
        source="" if shape is None else shape.source,
        prefix=p,
        world_key="cluster.actor_gpus",
    )
    _report(r, "the Megatron mesh: {} (ppo_trainer.mesh_problems)", problems, {}, p)
    return min(tp, pp, gpus) >= 1 and gpus % (tp * pp) == 0
