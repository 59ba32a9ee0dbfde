"""Preflight of the workload: model directories, the tokenizer and the data read as
``train`` reads them, each prompt fitting the models' context; the reward imported.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers

from ppo_driver.config.packages import _SIZE_FIELDS, ROLES, model_path
from ppo_driver.config.problems import ConfigProblem, ValidationReport
from ppo_driver.config.rules import _check_positive, _need
from ppo_driver.config.schema import DriverConfig, ModelConfig, Role

if TYPE_CHECKING:
    from ppo_driver.rollout import PromptDataset, Tokenizer


def _check_files(r: ValidationReport, cfg: DriverConfig) -> None:
    """Model directories (config.json, safetensors weights), the policy's tokenizer,
    and the prompt data sets, read and encoded line by line as ``train`` will."""
    shapes = _check_model_dirs(r, cfg)
    tokenizer = _check_tokenizer(r, cfg, shapes)
    _check_data(r, cfg, tokenizer)


def _hf_config(source: str) -> transformers.PretrainedConfig:
    """``transformers.AutoConfig`` of the model directory ``source``, as the workers load
    it (raises as that does). Several checks ask for it: it is read once per state of the
    directory's config.json."""
    stat = (Path(source) / "config.json").stat()
    return _hf_config_read(str(Path(source).absolute()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _hf_config_read(source: str, mtime_ns: int, size: int) -> transformers.PretrainedConfig:
    config: transformers.PretrainedConfig = transformers.AutoConfig.from_pretrained(source)
    return config


def _read_model_dir(key: str, path: str) -> tuple[ConfigProblem | None, dict[str, Any] | None]:
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
        _hf_config(str(model))  # what the workers read
    except Exception as exc:  # transformers raises many kinds for a bad config
        why = (
            f"transformers cannot read {config}: {type(exc).__name__}: {' '.join(str(exc).split())}"
        )
        return ConfigProblem(
            key, path, why, f"{fix}; fix config.json (AutoConfig.from_pretrained must load it)"
        ), None
    return None, hf


def _check_model_dirs(r: ValidationReport, cfg: DriverConfig) -> dict[Role, dict[str, Any]]:
    """Each ``model_path`` given: a directory with ``config.json`` (a JSON object) and
    ``*.safetensors`` weights. Returns the config.json of each role whose model comes
    from a directory (the critic's may be the policy's); sizes set beside a
    ``model_path`` are warned about (the checkpoint's config.json decides them)."""
    configs: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        path = getattr(cfg, role).model_path
        if path is not None:
            problem, hf = _read_model_dir(f"{role}.model_path", path)
            if problem is not None:
                r.errors.append(problem)
            elif hf is not None:
                configs[role] = hf
    out: dict[Role, dict[str, Any]] = {}
    for role in ROLES:
        own = getattr(cfg, role).model_path
        source: Role = role if own is not None or role != "critic" else "policy"
        if model_path(cfg, role) is None:
            continue
        if source in configs:
            out[role] = configs[source]
        where = f"{source}.model_path"
        for name in _SIZE_FIELDS:
            value, default = getattr(cfg.model(role), name), getattr(ModelConfig(), name)
            if value != default:
                r.warnings.append(
                    ConfigProblem(
                        f"{role}.{name}",
                        value,
                        f"has no effect: the {role} model comes from {where} (its "
                        "config.json gives the sizes)",
                        f"remove {role}.{name}"
                        + (", or set critic.model_path" if where != f"{role}.model_path" else ""),
                        severity="warning",
                    )
                )
    return out


def _check_vocabularies(
    r: ValidationReport,
    cfg: DriverConfig,
    shapes: Mapping[Role, Mapping[str, Any]],
    tokenizer: Tokenizer,
) -> None:
    """The tokenizer's ids fit each checkpoint's vocabulary (config.json ``vocab_size``)."""
    path = cfg.policy.model_path
    for role, hf in shapes.items():
        vocab = hf.get("vocab_size")
        key = (
            f"{role}.model_path" if cfg.model(role).model_path is not None else "policy.model_path"
        )
        if isinstance(vocab, int) and tokenizer.vocab_size > vocab:
            r.errors.append(
                ConfigProblem(
                    key,
                    cfg.model(role).model_path or path,
                    f"the tokenizer has {tokenizer.vocab_size} ids but the {role} model's "
                    f"vocabulary holds {vocab} (config.json vocab_size): token ids beyond it "
                    "have no embedding",
                    f"use a {role} model trained with this tokenizer",
                )
            )


def _check_tokenizer(
    r: ValidationReport, cfg: DriverConfig, shapes: Mapping[Role, Mapping[str, Any]]
) -> Tokenizer | None:
    """The tokenizer ``train`` uses (``ppo_driver.workload.load_tokenizer_for``): the
    policy directory's own, loaded with ``transformers.AutoTokenizer`` (local files
    only); the built-in character tokenizer without a ``policy.model_path``. Its ids
    must fit both models' vocabularies; ``rollout.apply_chat_template`` needs a chat
    template. Returns it, or None when it cannot be loaded (reported)."""
    from ppo_driver.rollout import TASK_ALPHABET, CharTokenizer, HFTokenizer  # lazy: torch

    path = cfg.policy.model_path
    tokenizer: Tokenizer
    if path is None:
        tokenizer = CharTokenizer(TASK_ALPHABET)
    elif "policy" not in shapes:
        return None  # the directory itself is refused (reported)
    else:
        try:
            tokenizer = HFTokenizer(path)
        except ValueError as exc:
            r.errors.append(
                ConfigProblem(
                    "policy.model_path",
                    path,
                    str(exc),
                    "save the model's tokenizer into that directory "
                    "(tokenizer.save_pretrained(dir)); the policy's directory gives both "
                    "the weights and the tokenizer",
                )
            )
            return None
    _check_vocabularies(r, cfg, shapes, tokenizer)
    if cfg.rollout.apply_chat_template and not getattr(tokenizer, "has_chat_template", False):
        why = (
            "the built-in task's character tokenizer has none (no policy.model_path)"
            if path is None
            else f"the tokenizer of {path} has none (no chat_template in its files)"
        )
        r.errors.append(
            ConfigProblem(
                "rollout.apply_chat_template",
                True,
                f"needs a chat template, and {why}",
                "set rollout.apply_chat_template=false, or policy.model_path to a model "
                "whose tokenizer has a chat template",
            )
        )
    return tokenizer


def _context_length(cfg: DriverConfig, role: Role) -> tuple[int, bool, str] | None:
    """``role``'s model context (``max_position_embeddings``), whether its positions are
    rotary (RoPE runs past it, worse; learned positions cannot), and where it is read;
    None for the built-in model or an unreadable config (reported elsewhere)."""
    source = model_path(cfg, role)
    if source is None:
        return None
    try:
        hf = _hf_config(source)
    except Exception:  # reported by _check_model_dirs
        return None
    length = getattr(hf, "max_position_embeddings", None)
    if not isinstance(length, int) or length <= 0:
        return None
    rotary = getattr(hf, "rope_parameters", None) is not None or hasattr(hf, "rope_theta")
    return length, rotary, f"{source}/config.json"


def _check_context(
    r: ValidationReport, cfg: DriverConfig, key: str, path: str, dataset: PromptDataset
) -> None:
    """The longest prompt of ``dataset`` plus ``rollout.max_new_tokens`` fits each
    model's context: an error for learned positions (generation and the trainer's
    forward would index past the table), a warning for rotary ones (the model runs
    past the length it was trained for)."""
    longest = max(range(len(dataset)), key=lambda i: len(dataset.prompt_ids(i)))
    prompt = len(dataset.prompt_ids(longest))
    new = cfg.rollout.max_new_tokens
    for role in ROLES:
        context = _context_length(cfg, role)
        if context is None or prompt + new <= context[0]:
            continue
        length, rotary, where = context
        what = (
            f"its longest prompt ({dataset.locations[longest]}: {prompt} tokens) plus "
            f"rollout.max_new_tokens={new} is {prompt + new} tokens, beyond the {role} "
            f"model's context of {length} (max_position_embeddings in {where})"
        )
        fix = (
            f"shorten or drop the long prompts, or lower rollout.max_new_tokens to at most "
            f"{max(length - prompt, 0)}"
        )
        if rotary:
            r.warnings.append(
                ConfigProblem(
                    key,
                    path,
                    f"{what}: the model runs past the length it was trained for",
                    fix,
                    severity="warning",
                )
            )
        else:
            r.errors.append(
                ConfigProblem(
                    key,
                    path,
                    f"{what}: its learned position table has no row past that",
                    fix,
                )
            )
        return


def _check_data(r: ValidationReport, cfg: DriverConfig, tokenizer: Tokenizer | None) -> None:
    """The data keys: each JSONL file read and encoded as ``train`` will (missing,
    empty, every bad line named by number), the prompt key, the evaluation schedule, the
    built-in task's options, and a reward for JSONL data."""
    from ppo_driver.rollout import DataError, PromptDataset, read_jsonl  # lazy: torch

    ro = cfg.rollout
    _need(
        r,
        "rollout.prompt_key",
        ro.prompt_key,
        bool(ro.prompt_key.strip()),
        "a field name",
        "prompt",
    )
    chat = ro.apply_chat_template and bool(getattr(tokenizer, "has_chat_template", False))
    for key, path in (
        ("rollout.dataset_path", ro.dataset_path),
        ("rollout.eval_dataset_path", ro.eval_dataset_path),
    ):
        if path is None or not ro.prompt_key.strip():
            continue
        try:
            if tokenizer is None:  # the tokenizer is refused (reported): the lines only
                read_jsonl(path, prompt_key=ro.prompt_key, messages=ro.apply_chat_template)
            else:
                dataset = PromptDataset.from_jsonl(
                    path, tokenizer, prompt_key=ro.prompt_key, chat_template=chat
                )
                _check_context(r, cfg, key, path, dataset)
        except DataError as exc:
            r.errors.append(
                ConfigProblem(
                    key,
                    path,
                    exc.problem,
                    f"{exc.fix}; or point {key} at another file"
                    + (
                        ", or remove it for the built-in task"
                        if key == "rollout.dataset_path"
                        else ""
                    ),
                )
            )
    _check_eval_schedule(r, cfg)
    _check_task_options(r, cfg)
    _check_reward_for_data(r, cfg)


def _check_eval_schedule(r: ValidationReport, cfg: DriverConfig) -> None:
    """``run.eval_every`` and ``rollout.eval_dataset_path``: both set, or neither."""
    every, eval_path = cfg.run.eval_every, cfg.rollout.eval_dataset_path
    if _check_positive(r, "run.eval_every", every, allow_zero=True):
        if every > 0 and eval_path is None:
            r.errors.append(
                ConfigProblem(
                    "run.eval_every",
                    every,
                    "evaluation needs a held-out data set, and rollout.eval_dataset_path is null",
                    "set rollout.eval_dataset_path to a JSONL file of held-out prompts, or "
                    "run.eval_every=0",
                )
            )
        elif every == 0 and eval_path is not None:
            r.errors.append(
                ConfigProblem(
                    "rollout.eval_dataset_path",
                    eval_path,
                    "is never evaluated: run.eval_every is 0 (off)",
                    "set run.eval_every to the number of steps between evaluations (e.g. 10), "
                    "or remove rollout.eval_dataset_path",
                )
            )


def _check_task_options(r: ValidationReport, cfg: DriverConfig) -> None:
    """``rollout.extra``: the built-in task's options (``max_count`` only)."""
    ro = cfg.rollout
    for name, value in ro.extra.items():
        if name != "max_count":
            r.errors.append(
                ConfigProblem(
                    f"rollout.extra.{name}",
                    value,
                    "unknown task option (the built-in task reads only max_count; a JSONL "
                    "record's own fields reach the reward)",
                    f"remove rollout.extra.{name}",
                )
            )
        elif ro.dataset_path is not None:
            r.errors.append(
                ConfigProblem(
                    "rollout.extra.max_count",
                    value,
                    "is the built-in task's option and has no effect with "
                    "rollout.dataset_path (the prompts come from that file)",
                    "remove rollout.extra.max_count, or rollout.dataset_path for the built-in task",
                )
            )


def _check_reward_for_data(r: ValidationReport, cfg: DriverConfig) -> None:
    """JSONL data needs a reward of its own (the built-in one scores the built-in task)."""
    ro = cfg.rollout
    paths = (("dataset_path", ro.dataset_path), ("eval_dataset_path", ro.eval_dataset_path))
    jsonl = [k for k, v in paths if v]
    if ro.reward is None and jsonl:
        r.errors.append(
            ConfigProblem(
                "rollout.reward",
                None,
                f"rollout.{jsonl[0]} is a JSONL data set, and the built-in reward (null) "
                "scores only the built-in task (it reads its records' char and count)",
                "set rollout.reward to your reward, 'path/to/reward.py:function' or "
                "'package.module:function' (records of the built-in task's form: "
                "'ppo_driver.rollout:repeat_reward')",
            )
        )


def _check_reward(r: ValidationReport, cfg: DriverConfig) -> None:
    """Import the reward function as ``train`` will (ppo_driver.rollout.load_reward_fn:
    a module's function, or a Python file's) and check it takes the rollout's keywords."""
    spec = cfg.rollout.reward
    if spec is None:
        return
    from ppo_driver.rollout import REWARD_FORMS, load_reward_fn  # lazy: imports torch

    fix = (
        f"set rollout.reward to {REWARD_FORMS} (a file path is relative to the working "
        "directory; a module must import here: check PYTHONPATH), naming a callable "
        "reward_fn(*, response, record, finish_reason) -> float, sync or async; or "
        "remove it for the built-in task's reward"
    )
    try:
        fn = load_reward_fn(spec)
    except ValueError as exc:
        r.errors.append(ConfigProblem("rollout.reward", spec, str(exc), fix))
        return
    except Exception as exc:  # the module raised while being imported
        r.errors.append(
            ConfigProblem(
                "rollout.reward",
                spec,
                f"importing it raised {type(exc).__name__}: {exc}",
                fix,
            )
        )
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: trust it
        return
    try:
        signature.bind(response="", record={}, finish_reason="stop")
    except TypeError as exc:
        r.errors.append(
            ConfigProblem(
                "rollout.reward",
                spec,
                "it cannot be called as reward_fn(response=..., record=..., "
                f"finish_reason=...) ({exc})",
                fix,
            )
        )
