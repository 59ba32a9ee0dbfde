"""What a run trains on: the tokenizer, the prompts, the held-out prompts and the reward,
from the config, loaded before Ray starts (``ppo_driver.run`` builds it first; every
problem here is one ``validate`` reports too, by key).

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

from dataclasses import dataclass

from ppo_driver.config import DriverConfig
from ppo_driver.rollout import (
    TASK_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    PromptDataset,
    RewardFn,
    Tokenizer,
    load_reward_fn,
    repeat_reward,
    synthetic_records,
)

__all__ = ["BUILTIN_PROMPTS", "Workload", "load_tokenizer_for", "load_workload"]

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
    """Tokenizer, prompts (encoded), held-out prompts and reward of ``cfg``; raises
    ``ValueError`` (:class:`~ppo_driver.rollout.DataError` for the data, naming file and
    line) on what ``validate`` refuses."""
    ro = cfg.rollout
    tokenizer = load_tokenizer_for(cfg)
    chat = ro.apply_chat_template
    if ro.dataset_path is None:
        records = synthetic_records(
            num_prompts=BUILTIN_PROMPTS,
            seed=cfg.run.seed,
            max_count=int(ro.extra.get("max_count", 8)),
        )
        dataset = PromptDataset(records, tokenizer, chat_template=chat)
    else:
        dataset = PromptDataset.from_jsonl(
            ro.dataset_path, tokenizer, prompt_key=ro.prompt_key, chat_template=chat
        )
    eval_dataset = None
    if ro.eval_dataset_path is not None and cfg.run.eval_every > 0:
        eval_dataset = PromptDataset.from_jsonl(
            ro.eval_dataset_path, tokenizer, prompt_key=ro.prompt_key, chat_template=chat
        )
    reward_fn = load_reward_fn(ro.reward) if ro.reward else repeat_reward
    return Workload(tokenizer, dataset, eval_dataset, reward_fn)
