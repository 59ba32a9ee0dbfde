"""Preflight of the files: the model directories (``ppo_driver._model_rules``) and the
workload (``ppo_driver.workload``: tokenizer, data, reward, loaded as ``train``
loads them), each by its own rules, then checked against each other: the tokenizer's ids
fit each vocabulary, each prompt fits each context.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ppo_driver import _model_rules
from ppo_driver.config.packages import ROLES
from ppo_driver.config.problems import ValidationReport
from ppo_driver.config.schema import DriverConfig, Role

if TYPE_CHECKING:
    from ppo_driver.rollout import PromptDataset, Tokenizer


def _check_files(r: ValidationReport, cfg: DriverConfig) -> None:
    """Model directories (config.json, safetensors weights), then the workload's own
    rules, then its tokenizer and data against the models."""
    from ppo_driver.workload import check_workload  # lazy: loads the engines

    shapes = _model_rules.check_model_dirs(r, cfg)
    check = check_workload(cfg, policy_dir_ok="policy" in shapes)
    r.add(check.problems)
    r.workload = check.workload
    if check.tokenizer is not None:
        _check_vocabularies(r, cfg, shapes, check.tokenizer)
    for key, (path, dataset) in check.datasets.items():
        _check_context(r, cfg, key, path, dataset)


def _check_vocabularies(
    r: ValidationReport,
    cfg: DriverConfig,
    shapes: Mapping[Role, Mapping[str, object]],
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
            r.error(
                key,
                cfg.model(role).model_path or path,
                f"the tokenizer has {tokenizer.vocab_size} ids but the {role} model's "
                f"vocabulary holds {vocab} (config.json vocab_size): token ids beyond it "
                "have no embedding",
                f"use a {role} model trained with this tokenizer",
            )


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
        context = _model_rules.context_length(cfg, role)
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
            r.warn(key, path, f"{what}: the model runs past the length it was trained for", fix)
        else:
            r.error(key, path, f"{what}: its learned position table has no row past that", fix)
        return
