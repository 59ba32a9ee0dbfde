"""What a run trains on: the tokenizer, the prompts, the held-out prompts and the reward,
from the config, loaded before Ray starts, and the rules of each. :func:`check_workload`
loads it and reports every problem by key (``validate`` calls it, and hands what it
loaded to ``train`` in the ``ValidConfig``); :func:`load_workload` raises them.

- tokenizer: the policy's (``policy.model_path``, ``transformers.AutoTokenizer``, local
  files only; EOS and pad from it, generation stops at its stop ids), else the built-in
  task's character tokenizer;
- prompts: ``rollout.dataset_path`` (JSONL, ``rollout.prompt_key``, optionally inside the
  tokenizer's chat template), else the built-in task's synthetic records;
- held-out prompts: ``rollout.eval_dataset_path`` (evaluated every ``run.eval_every``
  steps);
- reward: ``rollout.reward`` (``module:function`` or ``path/to/file.py:function``), else
  the built-in task's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from ppo_driver.config.problems import ConfigError, ConfigProblem, must_be
from ppo_driver.config.schema import DriverConfig
from ppo_driver.rollout import (
    REWARD_FORMS,
    TASK_ALPHABET,
    CharTokenizer,
    DataError,
    HFTokenizer,
    PromptDataset,
    RewardFn,
    Tokenizer,
    load_reward_fn,
    read_jsonl,
    repeat_reward,
    synthetic_records,
)
from ppo_driver.rollout._task import MAX_COUNT

__all__ = [
    "BUILTIN_MAX_COUNT",
    "BUILTIN_PROMPTS",
    "Workload",
    "WorkloadCheck",
    "check_workload",
    "load_tokenizer_for",
    "load_workload",
]

BUILTIN_PROMPTS = 4096
"""Prompts of the built-in task (then it wraps around)."""


@dataclass(frozen=True)
class Workload:
    """The tokenizer, prompts and reward of a run."""

    tokenizer: Tokenizer
    dataset: PromptDataset
    eval_dataset: PromptDataset | None
    reward_fn: RewardFn

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token ids that end a response (EOS, plus a generation config's)."""
        return tuple(getattr(self.tokenizer, "stop_ids", (self.tokenizer.eos_id,)))


def load_tokenizer_for(cfg: DriverConfig) -> Tokenizer:
    """The policy directory's tokenizer, or the built-in task's character tokenizer."""
    if cfg.policy.model_path is None:
        return CharTokenizer(TASK_ALPHABET)
    return HFTokenizer(cfg.policy.model_path)


def load_workload(cfg: DriverConfig) -> Workload:
    """Tokenizer, prompts (encoded), held-out prompts and reward of ``cfg``
    (:func:`check_workload`); :class:`~ppo_driver.config.ConfigError` with every problem
    ``validate`` would report for them (each data set's names its file and line)."""
    check = check_workload(cfg)
    if check.workload is None:
        raise ConfigError([p for p in check.problems if p.severity == "error"])
    return check.workload


BUILTIN_MAX_COUNT = 8
"""The built-in task's largest count, unless ``rollout.extra.max_count`` (its only option,
at most ``rollout._task.MAX_COUNT``) says otherwise."""


@dataclass
class WorkloadCheck:
    """What :func:`check_workload` loaded, and every problem by YAML key."""

    problems: list[ConfigProblem] = field(default_factory=list)
    tokenizer: Tokenizer | None = None
    # YAML key -> (path, data set): each JSONL data set read and encoded
    datasets: dict[str, tuple[str, PromptDataset]] = field(default_factory=dict)
    workload: Workload | None = None  # when nothing was refused


def check_workload(cfg: DriverConfig, *, policy_dir_ok: bool = True) -> WorkloadCheck:
    """Tokenizer, data, schedule, task options and reward of ``cfg``, loaded as ``train``
    uses them, every problem by key (never raises); ``policy_dir_ok``: whether
    ``policy.model_path`` (if set) is a usable model directory (else its tokenizer is not
    tried: ``validate`` reports the directory)."""
    check = WorkloadCheck()
    if cfg.policy.model_path is None or policy_dir_ok:
        check.tokenizer = _tokenizer(cfg, check.problems)
    check.problems += _data_problems(cfg, check)
    check.problems += eval_schedule_problems(cfg)
    check.problems += task_option_problems(cfg)
    reward_fn = _reward(cfg, check.problems)
    refused = any(p.severity == "error" for p in check.problems)
    if check.tokenizer is not None and reward_fn is not None and not refused:
        check.workload = _assemble(cfg, check, check.tokenizer, reward_fn)
    return check


def _assemble(
    cfg: DriverConfig, check: WorkloadCheck, tokenizer: Tokenizer, reward_fn: RewardFn
) -> Workload:
    """The :class:`Workload` of what ``check`` loaded; the built-in task's prompts when
    there is no ``rollout.dataset_path``, the held-out ones only with ``run.eval_every``."""
    ro = cfg.rollout
    if ro.dataset_path is None:
        max_count = int(ro.extra.get("max_count", BUILTIN_MAX_COUNT))
        records = synthetic_records(
            num_prompts=BUILTIN_PROMPTS, seed=cfg.run.seed, max_count=max_count
        )
        dataset = PromptDataset(records, tokenizer, chat_template=ro.apply_chat_template)
    else:
        dataset = check.datasets["rollout.dataset_path"][1]
    held_out = check.datasets.get("rollout.eval_dataset_path")
    eval_dataset = held_out[1] if held_out is not None and cfg.run.eval_every > 0 else None
    return Workload(tokenizer, dataset, eval_dataset, reward_fn)


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
    """``rollout.extra``: the built-in task's option ``max_count`` only, and only for the
    built-in task; JSONL data needs a reward of its own."""
    ro, out = cfg.rollout, []
    for name, value in ro.extra.items():
        key = f"rollout.extra.{name}"
        if name != "max_count":
            out.append(
                ConfigProblem(
                    key,
                    value,
                    "unknown task option (the built-in task reads only max_count; a JSONL "
                    "record's own fields reach the reward)",
                    f"remove {key}",
                )
            )
        elif isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            out.append(must_be(key, value, f"an integer in [1, {MAX_COUNT}]", BUILTIN_MAX_COUNT))
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


def _reward(cfg: DriverConfig, problems: list[ConfigProblem]) -> RewardFn | None:
    """``rollout.reward`` imported (``load_reward_fn``: a module's function, or a Python
    file's), else the built-in task's; None when it cannot be, or cannot take the
    rollout's keywords (reported)."""
    spec = cfg.rollout.reward
    if spec is None:
        return repeat_reward
    fix = (
        f"set rollout.reward to {REWARD_FORMS} (a file path is relative to the working "
        "directory; a module must import here: check PYTHONPATH), naming a callable "
        "reward_fn(*, response, record, finish_reason) -> float, sync or async; or "
        "remove it for the built-in task's reward"
    )
    try:
        fn = load_reward_fn(spec)
    except ValueError as exc:
        problems.append(ConfigProblem("rollout.reward", spec, str(exc), fix))
        return None
    except Exception as exc:  # the module raised while being imported
        why = f"importing it raised {type(exc).__name__}: {exc}"
        problems.append(ConfigProblem("rollout.reward", spec, why, fix))
        return None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: trust it
        return fn
    try:
        signature.bind(response="", record={}, finish_reason="stop")
    except TypeError as exc:
        why = (
            f"it cannot be called as reward_fn(response=..., record=..., finish_reason=...) ({exc})"
        )
        problems.append(ConfigProblem("rollout.reward", spec, why, fix))
        return None
    return fn
