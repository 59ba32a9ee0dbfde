"""The Megatron backend in ``validate``: its option and mesh rules as the trainer states
them (``ppo_trainer.option_problems`` / ``mesh_problems``, no megatron import; the
checkpoint family is ``_model_rules``'), and what spans both models (one backend, one
layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ppo_trainer import get_backend, mesh_problems, option_problems

from ppo_driver import _model_rules
from ppo_driver.config.packages import (
    MEGATRON_EXTRA,
    ROLES,
    _backend_options,
    _builtin_vocab_size,
    _report,
    model_path,
)
from ppo_driver.config.problems import ValidationReport
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
        r.error(
            f"{p}.enabled",
            True,
            f"the Megatron backend cannot be imported ({why})",
            f"install the extra {MEGATRON_EXTRA} (in this workspace: "
            f"`uv sync --extra megatron`), or set {p}.enabled=false",
        )
    mesh_ok = True
    for role in enabled:
        if why is None:
            r.add(_model_rules.megatron_model_problems(cfg, role))
        # ppo_trainer.option_problems: the rules parse_options and the backend's set-up
        # apply, on the backend_options train passes (te None: the extra is missing)
        p = f"{role}.megatron_cfg"
        te = None if why is not None else _te_available()
        options = _backend_options(cfg.model(role).megatron_cfg)
        who = "not supported by the Megatron backend: {} (ppo_trainer.option_problems)"
        _report(r, who, option_problems(options, prefix=p, te_available=te), {}, p)
        mesh_ok &= _check_mesh(r, cfg, role)
    _check_megatron_pair(r, cfg)
    return mesh_ok


def _megatron_import_error() -> str | None:
    """Why the trainer's Megatron backend cannot be imported here (None: it can)."""
    try:
        get_backend("megatron")
    except ImportError as exc:
        return str(exc).splitlines()[0]
    return None


def _te_available() -> bool:
    from ppo_trainer.megatron import transformer_engine_available  # lazy: the extra

    return transformer_engine_available()


def _warn_inert_megatron(r: ValidationReport, cfg: DriverConfig, role: Role) -> None:
    """``megatron_cfg`` settings of a model that trains with plain torch do nothing."""
    p = f"{role}.megatron_cfg"
    mine = _leaves(dataclasses.asdict(cfg.model(role).megatron_cfg))
    for name, default in _leaves(dataclasses.asdict(MegatronCfg())).items():
        if name != "enabled" and mine[name] != default:
            r.warn(
                f"{p}.{name}",
                mine[name],
                f"has no effect while {p}.enabled is false (the model trains with plain torch)",
                f"set {p}.enabled=true to use it, or remove {p}.{name}",
            )


def _leaves(tree: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"a.b": value}`` for each leaf of a nested mapping."""
    out: dict[str, object] = {}
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
        r.error(
            "critic.megatron_cfg.enabled",
            critic.enabled,
            "actor and critic must use the same backend and parallel layout (they share ranks)",
            f"set critic.megatron_cfg.enabled={str(policy.enabled).lower()}",
        )
        return
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        mine, theirs = getattr(critic, name), getattr(policy, name)
        key = f"critic.megatron_cfg.{name}"
        if mine != theirs and min(mine, theirs) >= 1 and not r.refused(key):
            r.error(
                key,
                mine,
                f"actor and critic must use the same parallel layout (policy has "
                f"{theirs}): the critic reuses the actor's placement bundles, critic "
                "rank r runs beside actor rank r and hands it its values",
                f"set critic.megatron_cfg.{name}={theirs}",
            )


def _model_shape(cfg: DriverConfig, role: Role) -> dict[str, Any]:
    """The head / layer / vocabulary counts the trainer builds ``role`` with, as
    ``mesh_problems`` arguments: the checkpoint's config.json with a model_path, else the
    tiny model of the config; ``{}`` when unknown (reported elsewhere)."""
    m = cfg.model(role)
    source = model_path(cfg, role)  # the critic's defaults to the policy's
    if source is None:
        if min(m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers) < 1:
            return {}  # reported by ppo_trainer.ModelSpec
        heads, kv_heads, layers = m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers
        vocab, where = (
            _builtin_vocab_size(),
            f"the {role}.* model sizes and the built-in task's vocabulary",
        )
    else:
        try:
            hf = _model_rules.hf_config(source)
            heads, layers, vocab = hf.num_attention_heads, hf.num_hidden_layers, hf.vocab_size
            kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        except Exception:  # reported by _check_model_dirs
            return {}
        where = str(Path(source) / "config.json")
    return {"heads": heads, "kv_heads": kv_heads, "layers": layers, "vocab": vocab, "source": where}


def _check_mesh(r: ValidationReport, cfg: DriverConfig, role: Role) -> bool:
    """The model's ranks as the shared placement holds them (one per training GPU,
    ``cluster.actor_gpus``): ``tp * pp`` must divide them (the rest is data parallel),
    ``tp`` the heads, key/value heads and vocabulary, ``pp`` the layers (what megatron's
    parallel_state and the trainer's transformer config refuse at set-up). Returns
    whether ``dp_size(role)`` is defined."""
    p = f"{role}.megatron_cfg"
    tp, pp = cfg.model_parallel_sizes(role)
    gpus = cfg.cluster.actor_gpus
    shape = _model_shape(cfg, role) if min(tp, pp) >= 1 else {}
    problems = mesh_problems(
        world_size=gpus, tp=tp, pp=pp, prefix=p, world_key="cluster.actor_gpus", **shape
    )
    _report(r, "the Megatron mesh: {} (ppo_trainer.mesh_problems)", problems, {}, p)
    return not mesh_problems(world_size=gpus, tp=tp, pp=pp)  # dp_size needs only these
