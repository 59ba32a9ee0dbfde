"""The driver's own keys (ranges no package reads) and the rules across packages
(the document's streaming rules, dtype vs. backend, group alignment over the meshes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from ppo_sampler import single_chunk_only

from ppo_driver.config.packages import ROLES, _streams
from ppo_driver.config.problems import ConfigProblem, ValidationReport
from ppo_driver.config.schema import ADV_NORMALIZATIONS, DriverConfig


def _need(
    r: ValidationReport, key: str, value: Any, ok: bool, rule: str, example: Any = None
) -> bool:
    """Record that ``key`` must be ``rule`` unless ``ok``; at most one such problem per key
    (a non-finite value, already reported, is not reported again as out of range)."""
    if ok:
        return True
    if not any(p.key == key for p in r.errors):
        eg = "" if example is None else f", e.g. {example}"
        r.errors.append(
            ConfigProblem(key, value, f"must be {rule}", f"set {key} to a value {rule}{eg}")
        )
    return False


def _check_positive(
    r: ValidationReport, key: str, value: float | int, *, allow_zero: bool = False
) -> bool:
    if allow_zero:
        return _need(r, key, value, value >= 0, ">= 0")
    if isinstance(value, int):
        return _need(r, key, value, value >= 1, ">= 1")
    return _need(r, key, value, value > 0, "> 0")


def _non_finite(node: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every NaN / infinite float of a config tree (set in code: YAML never gets here)."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _non_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            yield f"{prefix}{f.name}", value


def _check_driver_ranges(r: ValidationReport, cfg: DriverConfig) -> None:
    """Ranges of the keys only the driver reads (the packages check their own)."""
    ppo, arl, ro = cfg.ppo, cfg.async_rl, cfg.rollout
    for key, count in (
        ("ppo.num_generations_per_prompt", ppo.num_generations_per_prompt),
        ("ppo.ppo_epochs", ppo.ppo_epochs),
        ("ppo.critic_ppo_epochs", ppo.critic_ppo_epochs),
        ("ppo.critic_mini_batch_size", ppo.critic_mini_batch_size),
        ("run.num_steps", cfg.run.num_steps),
        ("run.keep_checkpoints", cfg.run.keep_checkpoints),
        ("rollout.max_new_tokens", ro.max_new_tokens),
        ("rollout.num_engines", ro.num_engines),
        ("rollout.max_consecutive_group_failures", ro.max_consecutive_group_failures),
    ):
        _check_positive(r, key, count)
    for key, amount in (
        ("ppo.critic_warmup_steps", ppo.critic_warmup_steps),
        ("run.checkpoint_every", cfg.run.checkpoint_every),
        ("async_rl.max_prompts_in_flight", arl.max_prompts_in_flight),
        ("rollout.decode_delay_s", ro.decode_delay_s),
        ("rollout.reward_timeout_s", ro.reward_timeout_s),
    ):
        _check_positive(r, key, amount, allow_zero=True)
    _check_positive(r, "async_rl.poll_interval_s", arl.poll_interval_s)
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    _need(r, "run.log_level", cfg.run.log_level, cfg.run.log_level in levels,
          f"one of {', '.join(levels)}", "INFO")  # fmt: skip
    if cfg.cluster.num_cpus is not None:
        _check_positive(r, "cluster.num_cpus", cfg.cluster.num_cpus)
    for key, val in (
        ("ppo.adv_estimator.gamma", ppo.adv_estimator.gamma),
        ("ppo.adv_estimator.lam", ppo.adv_estimator.lam),
    ):
        _need(r, key, val, 0.0 <= val <= 1.0, "in [0, 1]")
    norm = ppo.adv_estimator.normalization
    _need(
        r,
        "ppo.adv_estimator.normalization",
        norm,
        norm in ADV_NORMALIZATIONS,
        " or ".join(ADV_NORMALIZATIONS),
        ADV_NORMALIZATIONS[0],
    )

    # generation: what the engines' SamplingParams accept (temperature 0 is greedy)
    _need(r, "rollout.temperature", ro.temperature, ro.temperature >= 0, ">= 0 (0: greedy)")
    _need(r, "rollout.top_p", ro.top_p, 0.0 < ro.top_p <= 1.0, "in (0, 1]", 1.0)
    if "max_count" in ro.extra:  # the built-in task's largest count (synthetic_records)
        count = ro.extra["max_count"]
        ok = isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= 99
        _need(r, "rollout.extra.max_count", count, ok, "an integer in [1, 99]", 8)


def _check_rules(r: ValidationReport, cfg: DriverConfig) -> None:
    """The document's rules: no reward-level KL (shared actor/critic). Several policy
    epochs while streaming are the project's extension (the pump's ``train_epochs``)."""
    if cfg.ppo.kl_coef != 0:
        r.errors.append(
            ConfigProblem(
                "ppo.kl_coef",
                cfg.ppo.kl_coef,
                "reward-level KL (folded into GAE rewards) is not supported when actor and critic share "
                "devices: the critic cannot fold the actor's log-probs into its targets",
                "set ppo.kl_coef=0 and use the KL loss instead (ppo.kl_loss_coef > 0)",
            )
        )


def _check_dtype(r: ValidationReport, cfg: DriverConfig) -> None:
    """``policy/critic.dtype``: half precision only where the optimizer keeps float32
    master weights (Megatron). The torch backend steps AdamW on the parameters in their
    own dtype, where an update below bfloat16's resolution (lr 1e-6 on weights ~1e-2)
    rounds away: the run would look healthy and not learn. float16 is refused too: its
    loss scaling stops the run at the first overflow instead of skipping the step.
    Unknown names are the trainer's ``ModelSpec`` check (same key)."""
    for section in ROLES:
        m = cfg.model(section)
        key = f"{section}.dtype"
        if m.dtype == "float16":
            r.errors.append(
                ConfigProblem(
                    key,
                    m.dtype,
                    "float16 training needs dynamic loss scaling that skips overflowing "
                    "steps; here an overflow stops the run",
                    f"set {key}=bfloat16 (with {section}.megatron_cfg.enabled=true) or float32",
                )
            )
        elif m.dtype == "bfloat16" and not m.megatron_cfg.enabled:
            r.errors.append(
                ConfigProblem(
                    key,
                    m.dtype,
                    "the torch backend keeps no float32 master weights: AdamW updates "
                    "smaller than bfloat16's resolution are lost and the model stops "
                    "learning",
                    f"set {section}.megatron_cfg.enabled=true (bf16 compute, fp32 master "
                    f"weights), or {key}=float32",
                )
            )


def _check_colocated_lookahead(r: ValidationReport, cfg: DriverConfig) -> None:
    """Colocated generation time-shares the training devices: the engines hold them only
    while no trainer model is resident (between a step's refit and its batch). Generation
    ahead of the policy (look-ahead >= 1) would run during training, on the same devices."""
    lookahead = cfg.async_rl.sampler.max_lookahead_versions
    if cfg.cluster.colocate and lookahead >= 1:
        r.errors.append(
            ConfigProblem(
                "async_rl.sampler.max_lookahead_versions",
                lookahead,
                "with cluster.colocate=true the engines share the training devices and "
                "release their memory while the actor and the critic train; generating "
                "the next step's samples ahead of the policy would need them during training",
                "set async_rl.sampler.max_lookahead_versions=0, or cluster.colocate=false "
                "with cluster.rollout_gpus >= 1 (generation on devices of its own)",
            )
        )


def _check_alignment(r: ValidationReport, cfg: DriverConfig) -> None:
    """Batch and minimum: multiples of both models' data-parallel and micro-batch sizes."""
    ppo = cfg.ppo
    batch, minimum = cfg.batch_groups, cfg.min_groups
    if batch < 1 or minimum < 1:
        return  # reported by ppo_sampler.SamplerConfig
    try:
        align = cfg.group_alignment
    except ValueError as exc:
        if not r.errors:  # otherwise a consequence of a size reported already
            r.errors.append(
                ConfigProblem(
                    "ppo.num_prompts_per_step",
                    batch,
                    f"cannot compute the group alignment ({exc})",
                    "fix the data-parallel and micro-batch sizes",
                )
            )
        return
    dp = (cfg.dp_size("policy"), cfg.dp_size("critic"))
    mini = ppo.critic_mini_batch_size
    if mini > 0 and mini % dp[1]:
        lo = max(dp[1], mini - mini % dp[1])
        r.errors.append(
            ConfigProblem(
                "ppo.critic_mini_batch_size",
                mini,
                f"not a multiple of the critic's data-parallel size {dp[1]}: each rank trains "
                "on an equal slice of every global mini-batch",
                f"set ppo.critic_mini_batch_size to a multiple of {dp[1]}, e.g. {lo} or "
                f"{lo + dp[1]}",
            )
        )
    checked = [("ppo.num_prompts_per_step", batch)]
    if minimum <= batch:  # a minimum above the batch is reported as such, not as unaligned
        checked.append(("async_rl.min_groups_for_streaming_train", minimum))
    for key, val in checked:
        if val % align:
            lo = max(align, val - val % align)
            r.errors.append(
                ConfigProblem(
                    key,
                    val,
                    f"not a multiple of the group alignment {align} (the groups whose samples split evenly over "
                    f"the data-parallel ranks (policy {dp[0]}, critic {dp[1]}) and micro-batches "
                    f"(policy {cfg.policy.train_micro_batch_size}, critic {cfg.critic.train_micro_batch_size}) "
                    f"with {ppo.num_generations_per_prompt} generations per prompt)",
                    f"set {key} to a multiple of {align}, e.g. {lo} or {lo + align}",
                )
            )
    _warn_single_chunk(r, cfg, align)


def _warn_single_chunk(r: ValidationReport, cfg: DriverConfig, align: int) -> None:
    """Streaming whose minimum can never leave the tail floor: every step is ONE chunk."""
    batch, minimum = cfg.batch_groups, cfg.min_groups
    if (
        _streams(cfg)
        and batch % align == 0
        and minimum % align == 0
        and single_chunk_only(batch=batch, min_groups=minimum, alignment=align)
    ):
        floor = math.ceil(minimum / 2)
        r.warnings.append(
            ConfigProblem(
                "async_rl.min_groups_for_streaming_train",
                minimum,
                f"with batch {batch} this minimum can never leave the tail floor of {floor} groups, so every "
                "step runs as ONE chunk, although the streaming requirements still apply",
                f"lower it to at most about two thirds of the batch (e.g. {max(align, (batch // 3) // align * align)}) "
                f"to stream, or set it to {batch} for full-batch mode",
                severity="warning",
            )
        )
