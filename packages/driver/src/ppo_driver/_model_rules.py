"""The model directories in ``validate`` (``policy/critic.model_path``): what the
trainer's workers and the engines load from them (a ``config.json`` transformers reads,
``*.safetensors`` weights), the sizes the checkpoint decides instead of the config, and
whether the Megatron backend builds it (``ppo_trainer.megatron.model_config_problems``).

``ppo_driver.config`` imports this module as a whole (``from ppo_driver import
_model_rules``): it imports ``ppo_driver.config``'s submodules in turn.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ppo_driver.config.packages import _SIZE_FIELDS, ROLES, model_path
from ppo_driver.config.problems import ConfigProblem, ValidationReport
from ppo_driver.config.schema import DriverConfig, ModelConfig, Role

if TYPE_CHECKING:  # imported where a model directory is read (the built-in model needs none)
    import transformers


def hf_config(source: str) -> transformers.PretrainedConfig:
    """``transformers.AutoConfig`` of the model directory ``source``, as the workers load
    it (raises as that does). Several checks ask for it: it is read once per state of the
    directory's config.json."""
    stat = (Path(source) / "config.json").stat()
    return _hf_config_read(str(Path(source).absolute()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _hf_config_read(source: str, mtime_ns: int, size: int) -> transformers.PretrainedConfig:
    import transformers

    config: transformers.PretrainedConfig = transformers.AutoConfig.from_pretrained(source)
    return config


def read_model_dir(key: str, path: str) -> tuple[ConfigProblem | None, dict[str, object] | None]:
    """The config.json of the model directory ``path`` (``key``: its YAML key), or the
    problem that refuses it: missing, no config.json, not JSON, no safetensors weights,
    a config transformers cannot read."""
    fix = (
        f"point {key} at a local Hugging Face model directory (config.json, "
        "*.safetensors and, for the policy, the tokenizer files), or remove it for the "
        "built-in tiny model"
    )
    model = Path(path)
    config = model / "config.json"
    if not model.exists():
        return ConfigProblem(key, path, f"{model} does not exist", fix), None
    if not model.is_dir():
        return ConfigProblem(key, path, f"{model} is not a directory", fix), None
    if not config.is_file():
        return ConfigProblem(key, path, f"{model} has no config.json", fix), None
    try:
        hf = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return ConfigProblem(key, path, f"{config} is not readable JSON ({exc})", fix), None
    if not isinstance(hf, dict):
        return ConfigProblem(key, path, f"{config} is not a JSON object", fix), None
    if not any(model.glob("*.safetensors")):
        why = (
            f"{model} has no *.safetensors weights (the trainer loads safetensors only, "
            "never pickled *.bin files)"
        )
        safe = f"{fix}; convert the weights with save_pretrained(..., safe_serialization=True)"
        return ConfigProblem(key, path, why, safe), None
    try:
        hf_config(str(model))  # what the workers read
    except Exception as exc:  # transformers raises many kinds for a bad config
        why = (
            f"transformers cannot read {config}: {type(exc).__name__}: {' '.join(str(exc).split())}"
        )
        return ConfigProblem(
            key, path, why, f"{fix}; fix config.json (AutoConfig.from_pretrained must load it)"
        ), None
    return None, hf


def check_model_dirs(r: ValidationReport, cfg: DriverConfig) -> dict[Role, dict[str, object]]:
    """Each ``model_path`` given: a directory with ``config.json`` (a JSON object) and
    ``*.safetensors`` weights. Returns the config.json of each role whose model comes
    from a directory (the critic's may be the policy's); sizes set beside a
    ``model_path`` are warned about (the checkpoint's config.json decides them)."""
    configs: dict[str, dict[str, object]] = {}
    for role in ROLES:
        path = getattr(cfg, role).model_path
        if path is not None:
            problem, hf = read_model_dir(f"{role}.model_path", path)
            if problem is not None:
                r.errors.append(problem)
            elif hf is not None:
                configs[role] = hf
    out: dict[Role, dict[str, object]] = {}
    for role in ROLES:
        own = getattr(cfg, role).model_path
        source: Role = role if own is not None or role != "critic" else "policy"
        if model_path(cfg, role) is None:
            continue
        if source in configs:
            out[role] = configs[source]
        where, borrowed = f"{source}.model_path", source != role
        for name in _SIZE_FIELDS:
            value, default = getattr(cfg.model(role), name), getattr(ModelConfig(), name)
            if value != default:
                r.warn(
                    f"{role}.{name}",
                    value,
                    f"has no effect: the {role} model comes from {where} (its "
                    "config.json gives the sizes)",
                    f"remove {role}.{name}" + (", or set critic.model_path" if borrowed else ""),
                )
    return out


def context_length(cfg: DriverConfig, role: Role) -> tuple[int, bool, str] | None:
    """``role``'s model context (``max_position_embeddings``), whether its positions are
    rotary (RoPE runs past it, worse; learned positions cannot), and where it is read;
    None for the built-in model or an unreadable config (reported elsewhere)."""
    source = model_path(cfg, role)
    if source is None:
        return None
    try:
        hf = hf_config(source)
    except Exception:  # reported by _check_model_dirs
        return None
    length = getattr(hf, "max_position_embeddings", None)
    if not isinstance(length, int) or length <= 0:
        return None
    rotary = getattr(hf, "rope_parameters", None) is not None or hasattr(hf, "rope_theta")
    return length, rotary, f"{source}/config.json"


def megatron_model_problems(cfg: DriverConfig, role: Role) -> list[ConfigProblem]:
    """The checkpoint ``role`` is built from is one the megatron backend builds
    (``ppo_trainer.megatron.model_config_problems``: the Llama / Qwen2 family with plain
    RoPE); the built-in tiny model always is."""
    from ppo_trainer.megatron import MODEL_FAMILY, model_config_problems  # lazy: the extra

    source = model_path(cfg, role)
    if source is None:
        return []
    key = f"{role}.model_path" if cfg.model(role).model_path is not None else "policy.model_path"
    try:
        problems = model_config_problems(hf_config(source))
    except Exception:  # an unreadable directory: reported by check_model_dirs
        return []
    if not problems:
        return []
    return [
        ConfigProblem(
            key,
            source,
            f"the {role}'s model cannot be built by the megatron backend: {'; '.join(problems)}",
            f"use a {'/'.join(MODEL_FAMILY)} model with plain RoPE, or set "
            f"{role}.megatron_cfg.enabled=false (the torch backend builds any causal LM)",
        )
    ]
