"""The workload's rules in ``validate`` (``ppo_driver.workload`` loads it for ``train``):
the tokenizer and its chat template, the prompt data read and encoded as ``train`` reads
them, the evaluation schedule, the built-in task's options, and the reward imported.

:func:`workload_problems` loads each part with the very functions ``load_workload``
calls and returns what it loaded, so ``ppo_driver.config`` can check it against the
models (vocabulary, context) without reading anything twice.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from ppo_driver.config.problems import ConfigProblem, must_be
from ppo_driver.config.schema import DriverConfig
from ppo_driver.rollout import (
    REWARD_FORMS,
    DataError,
    PromptDataset,
    Tokenizer,
    load_reward_fn,
    read_jsonl,
)
from ppo_driver.workload import load_tokenizer_for

TASK_OPTIONS = {"max_count": "an integer in [1, 99]"}
"""``rollout.extra``: the built-in task's options (``synthetic_records``) and their rule."""


@dataclass
class WorkloadCheck:
    """What :func:`workload_problems` loaded, and every problem by YAML key."""

    problems: list[ConfigProblem] = field(default_factory=list)
    tokenizer: Tokenizer | None = None
    # YAML key -> (path, data set): each JSONL data set read and encoded
    datasets: dict[str, tuple[str, PromptDataset]] = field(default_factory=dict)


def workload_problems(cfg: DriverConfig, *, policy_dir_ok: bool) -> WorkloadCheck:
    """Tokenizer, data, schedule, task options and reward of ``cfg``, as ``train`` loads
    them; ``policy_dir_ok``: whether ``policy.model_path`` (if set) is a usable model
    directory (else its tokenizer is not tried: the directory is reported already)."""
    check = WorkloadCheck()
    if cfg.policy.model_path is None or policy_dir_ok:
        check.tokenizer = _tokenizer(cfg, check.problems)
    check.problems += _data_problems(cfg, check)
    check.problems += eval_schedule_problems(cfg)
    check.problems += task_option_problems(cfg)
    check.problems += reward_problems(cfg)
    return check


def _tokenizer(cfg: DriverConfig, problems: list[ConfigProblem]) -> Tokenizer | None:
    """The tokenizer ``train`` uses (``load_tokenizer_for``); ``rollout.apply_chat_template``
    needs it to have a chat template. None when it cannot be loaded (reported)."""
    path = cfg.policy.model_path
    try:
        tokenizer = load_tokenizer_for(cfg)
    except ValueError as exc:
        problems.append(
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
    if cfg.rollout.apply_chat_template and not getattr(tokenizer, "has_chat_template", False):
        why = (
            "the built-in task's character tokenizer has none (no policy.model_path)"
            if path is None
            else f"the tokenizer of {path} has none (no chat_template in its files)"
        )
        problems.append(
            ConfigProblem(
                "rollout.apply_chat_template",
                True,
                f"needs a chat template, and {why}",
                "set rollout.apply_chat_template=false, or policy.model_path to a model "
                "whose tokenizer has a chat template",
            )
        )
    return tokenizer


def _data_problems(cfg: DriverConfig, check: WorkloadCheck) -> list[ConfigProblem]:
    """Each JSONL file read and encoded as ``train`` will (missing, empty, every bad line
    named by number; without a tokenizer, the lines only), and the prompt key."""
    ro, tokenizer = cfg.rollout, check.tokenizer
    if not ro.prompt_key.strip():
        return [must_be("rollout.prompt_key", ro.prompt_key, "a field name", "prompt")]
    chat = ro.apply_chat_template and bool(getattr(tokenizer, "has_chat_template", False))
    out = []
    for key, path in (
        ("rollout.dataset_path", ro.dataset_path),
        ("rollout.eval_dataset_path", ro.eval_dataset_path),
    ):
        if path is None:
            continue
        try:
            if tokenizer is None:  # the tokenizer is refused (reported): the lines only
                read_jsonl(path, prompt_key=ro.prompt_key, messages=ro.apply_chat_template)
            else:
                dataset = PromptDataset.from_jsonl(
                    path, tokenizer, prompt_key=ro.prompt_key, chat_template=chat
                )
                check.datasets[key] = (path, dataset)
        except DataError as exc:
            builtin = (
                ", or remove it for the built-in task" if key == "rollout.dataset_path" else ""
            )
            fix = f"{exc.fix}; or point {key} at another file{builtin}"
            out.append(ConfigProblem(key, path, exc.problem, fix))
    return out


def eval_schedule_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """``run.eval_every`` and ``rollout.eval_dataset_path``: both set, or neither (a
    negative ``run.eval_every`` is the schema's range check)."""
    every, path = cfg.run.eval_every, cfg.rollout.eval_dataset_path
    if every > 0 and path is None:
        return [
            ConfigProblem(
                "run.eval_every",
                every,
                "evaluation needs a held-out data set, and rollout.eval_dataset_path is null",
                "set rollout.eval_dataset_path to a JSONL file of held-out prompts, or "
                "run.eval_every=0",
            )
        ]
    if every == 0 and path is not None:
        return [
            ConfigProblem(
                "rollout.eval_dataset_path",
                path,
                "is never evaluated: run.eval_every is 0 (off)",
                "set run.eval_every to the number of steps between evaluations (e.g. 10), "
                "or remove rollout.eval_dataset_path",
            )
        ]
    return []


def task_option_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """``rollout.extra``: the built-in task's options only (:data:`TASK_OPTIONS`), and
    only for the built-in task; JSONL data needs a reward of its own."""
    ro, out = cfg.rollout, []
    for name, value in ro.extra.items():
        key = f"rollout.extra.{name}"
        if name not in TASK_OPTIONS:
            out.append(
                ConfigProblem(
                    key,
                    value,
                    "unknown task option (the built-in task reads only max_count; a JSONL "
                    "record's own fields reach the reward)",
                    f"remove {key}",
                )
            )
        elif not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 99):
            out.append(must_be(key, value, TASK_OPTIONS[name], 8))
        elif ro.dataset_path is not None:
            out.append(
                ConfigProblem(
                    key,
                    value,
                    "is the built-in task's option and has no effect with "
                    "rollout.dataset_path (the prompts come from that file)",
                    f"remove {key}, or rollout.dataset_path for the built-in task",
                )
            )
    jsonl = [k for k in ("dataset_path", "eval_dataset_path") if getattr(ro, k)]
    if ro.reward is None and jsonl:
        out.append(
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
    return out


def reward_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """Import ``rollout.reward`` as ``train`` will (``load_reward_fn``: a module's
    function, or a Python file's) and check it takes the rollout's keywords."""
    spec = cfg.rollout.reward
    if spec is None:
        return []
    fix = (
        f"set rollout.reward to {REWARD_FORMS} (a file path is relative to the working "
        "directory; a module must import here: check PYTHONPATH), naming a callable "
        "reward_fn(*, response, record, finish_reason) -> float, sync or async; or "
        "remove it for the built-in task's reward"
    )
    try:
        fn = load_reward_fn(spec)
    except ValueError as exc:
        return [ConfigProblem("rollout.reward", spec, str(exc), fix)]
    except Exception as exc:  # the module raised while being imported
        why = f"importing it raised {type(exc).__name__}: {exc}"
        return [ConfigProblem("rollout.reward", spec, why, fix)]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: trust it
        return []
    try:
        signature.bind(response="", record={}, finish_reason="stop")
    except TypeError as exc:
        why = (
            f"it cannot be called as reward_fn(response=..., record=..., finish_reason=...) ({exc})"
        )
        return [ConfigProblem("rollout.reward", spec, why, fix)]
    return []
