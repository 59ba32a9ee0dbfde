"""The driver's own keys (the ranges ``schema`` declares) and the rules across packages
(the document's streaming rules, dtype vs. backend, group alignment over the meshes).
"""

from __future__ import annotations

import dataclasses
import math

from ppo_sampler import single_chunk_only
from ppo_trainer import reward_kl_problem

from ppo_driver.config.packages import ROLES, _report, _streams
from ppo_driver.config.problems import ValidationReport, _non_finite_problem, must_be
from ppo_driver.config.schema import DriverConfig


def _check_fields(r: ValidationReport, node: object, prefix: str = "") -> None:
    """Every field of the tree: a NaN / infinite float (set in code: loading refuses them
    in YAML) and a value outside the range its schema field declares (``bounded``: the
    keys no package reads; the packages check their own). One problem per key."""
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(r, value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            r.errors.append(_non_finite_problem(key, value))
        elif "rule" in f.metadata and value is not None and not f.metadata["ok"](value):
            r.errors.append(must_be(key, value, f.metadata["rule"], f.metadata["example"]))


def _check_rules(r: ValidationReport, cfg: DriverConfig) -> None:
    """The document's rules: no reward-level KL with a shared actor/critic
    (``ppo_trainer.reward_kl_problem``). Several policy epochs while streaming are the
    project's extension (the pump's ``train_epochs``)."""
    problem = reward_kl_problem(kl_coef=cfg.ppo.kl_coef)
    fix = "set ppo.kl_coef=0 and use the KL loss instead (ppo.kl_loss_coef > 0)"
    _report(r, "{}", [problem] if problem else [], {}, "ppo", {"ppo.kl_coef": fix})


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
            r.error(
                key,
                m.dtype,
                "float16 training needs dynamic loss scaling that skips overflowing "
                "steps; here an overflow stops the run",
                f"set {key}=bfloat16 (with {section}.megatron_cfg.enabled=true) or float32",
            )
        elif m.dtype == "bfloat16" and not m.megatron_cfg.enabled:
            r.error(
                key,
                m.dtype,
                "the torch backend keeps no float32 master weights: AdamW updates "
                "smaller than bfloat16's resolution are lost and the model stops learning",
                f"set {section}.megatron_cfg.enabled=true (bf16 compute, fp32 master "
                f"weights), or {key}=float32",
            )


def _check_block_order(r: ValidationReport, cfg: DriverConfig) -> None:
    """``async_rl.block_order``: ``length`` files groups by the engines' progress
    reports, which only the embedded engine gives; and it orders fixed blocks only."""
    order = cfg.async_rl.block_order
    key = "async_rl.block_order"
    if any(p.key == key for p in r.errors):
        return  # an unknown value, reported by the field check
    if order == "length" and cfg.rollout.engine != "embedded":
        r.error(
            key,
            order,
            f"needs the engines' progress reports (the tokens each group has drawn), "
            f"which rollout.engine={cfg.rollout.engine} does not give",
            f"set {key}=dispatch (fixed blocks wait for their slowest group) or "
            "async_rl.deterministic_chunks=false (chunks as groups arrive)",
        )
    elif order is not None and not cfg.fixed_chunks:
        r.warn(
            key,
            order,
            "orders fixed blocks, and the chunks here are cut as groups arrive "
            "(async_rl.deterministic_chunks resolved to false)",
            f"remove {key}, or set async_rl.deterministic_chunks=true",
        )


def _check_colocated_lookahead(r: ValidationReport, cfg: DriverConfig) -> None:
    """Colocated generation time-shares the training devices: the engines hold them only
    while no trainer model is resident (between a step's refit and its batch). Generation
    ahead of the policy (look-ahead >= 1) would run during training, on the same devices."""
    lookahead = cfg.async_rl.sampler.max_lookahead_versions
    if cfg.cluster.colocate and lookahead >= 1:
        r.error(
            "async_rl.sampler.max_lookahead_versions",
            lookahead,
            "with cluster.colocate=true the engines share the training devices and "
            "release their memory while the actor and the critic train; generating "
            "the next step's samples ahead of the policy would need them during training",
            "set async_rl.sampler.max_lookahead_versions=0, or cluster.colocate=false "
            "with cluster.rollout_gpus >= 1 (generation on devices of its own)",
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
            r.error(
                "ppo.num_prompts_per_step",
                batch,
                f"cannot compute the group alignment ({exc})",
                "fix the data-parallel and micro-batch sizes",
            )
        return
    dp = (cfg.dp_size("policy"), cfg.dp_size("critic"))
    mini = ppo.critic_mini_batch_size
    if mini > 0:
        why = "each rank trains on an equal slice of every global mini-batch"
        _multiple(
            r, "ppo.critic_mini_batch_size", mini, dp[1], "the critic's data-parallel size", why
        )
    micro = (cfg.policy.train_micro_batch_size, cfg.critic.train_micro_batch_size)
    why = (
        f"the groups whose samples split evenly over the data-parallel ranks (policy {dp[0]}, "
        f"critic {dp[1]}) and micro-batches (policy {micro[0]}, critic {micro[1]}) with "
        f"{ppo.num_generations_per_prompt} generations per prompt"
    )
    _multiple(r, "ppo.num_prompts_per_step", batch, align, "the group alignment", why)
    if minimum <= batch:  # a minimum above the batch is reported as such, not as unaligned
        key = "async_rl.min_groups_for_streaming_train"
        _multiple(r, key, minimum, align, "the group alignment", why)
    _warn_single_chunk(r, cfg, align)


def _multiple(r: ValidationReport, key: str, value: int, n: int, what: str, why: str) -> None:
    """``key`` must be a multiple of ``n`` (``what``, ``why`` it must)."""
    if value % n:
        lo = max(n, value - value % n)
        fix = f"set {key} to a multiple of {n}, e.g. {lo} or {lo + n}"
        r.error(key, value, f"not a multiple of {what} {n}: {why}", fix)


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
        example = max(align, (batch // 3) // align * align)
        r.warn(
            "async_rl.min_groups_for_streaming_train",
            minimum,
            f"with batch {batch} this minimum can never leave the tail floor of {floor} "
            "groups, so every step runs as ONE chunk, although the streaming requirements "
            "still apply",
            f"lower it to at most about two thirds of the batch (e.g. {example}) to stream, "
            f"or set it to {batch} for full-batch mode",
        )
