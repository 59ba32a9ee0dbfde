"""Typed driver configuration: YAML plus dotted overrides, and start-up validation.

The key names follow ``reference/colocated-ppo-streaming.md`` (``ppo.*``, ``async_rl.*``,
``policy.megatron_cfg.*``). Loading never raises on the first problem: every unknown
key, every wrong type and every broken rule is collected, so ``ppo-driver validate``
can report them all at once. Each problem names the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "AdvEstimatorConfig",
    "AsyncRLConfig",
    "ClusterConfig",
    "ConfigError",
    "ConfigProblem",
    "DriverConfig",
    "MegatronCfg",
    "MegatronOptimizerCfg",
    "ModelConfig",
    "PPOConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplerCfg",
    "ValidationReport",
    "apply_overrides",
    "default_config_path",
    "load_config",
    "validate",
]

SAMPLER_NAMES = ("in_order", "ready_first")
STREAMING_SAMPLERS = ("in_order", "ready_first")


# --------------------------------------------------------------------------- schema


@dataclass
class RunConfig:
    """Run bookkeeping (not from the document)."""

    name: str = "tiny"
    output_dir: str = "runs"
    seed: int = 0
    num_steps: int = 100
    checkpoint_every: int = 25
    keep_checkpoints: int = 2
    progress: bool = True


@dataclass
class AdvEstimatorConfig:
    normalize_advantages: bool = True
    gamma: float = 1.0
    lam: float = 0.95


@dataclass
class PPOConfig:
    num_prompts_per_step: int = 16
    num_generations_per_prompt: int = 4
    ppo_epochs: int = 1
    critic_ppo_epochs: int = 2
    critic_warmup_steps: int = 0
    critic_mini_batch_size: int = 32
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    kl_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "sample"
    adv_estimator: AdvEstimatorConfig = field(default_factory=AdvEstimatorConfig)


@dataclass
class SamplerCfg:
    name: str = "in_order"
    max_lookahead_versions: int = 1
    max_staleness_versions: int = 1
    evict_stale: bool = False


@dataclass
class AsyncRLConfig:
    min_groups_for_streaming_train: int = 4
    max_prompts_in_flight: int = 0  # 0: num_prompts_per_step * (1 + lookahead)
    poll_interval_s: float = 0.02
    sampler: SamplerCfg = field(default_factory=SamplerCfg)


@dataclass
class MegatronOptimizerCfg:
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False


@dataclass
class MegatronCfg:
    enabled: bool = False
    use_megatron_fsdp: bool = False
    fp8_param: bool = False
    fp8_recipe: str | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    optimizer: MegatronOptimizerCfg = field(default_factory=MegatronOptimizerCfg)


@dataclass
class ModelConfig:
    """One trained model (``policy`` or ``critic``)."""

    model_path: str | None = None
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    train_micro_batch_size: int | None = None
    megatron_cfg: MegatronCfg = field(default_factory=MegatronCfg)


@dataclass
class ClusterConfig:
    """Devices: actor and critic share ``actor_gpus``; generation gets ``rollout_gpus``."""

    actor_gpus: int = 1
    rollout_gpus: int = 1
    colocate: bool = False
    logical_gpus: bool = True
    num_cpus: int | None = None


@dataclass
class RolloutConfig:
    task: str = "builtin"
    dataset_path: str | None = None
    reward: str | None = None
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    num_engines: int = 1
    # Seconds the embedded engine waits between decode steps: emulates a slower
    # generation device on CPU (tests, what-if benchmarks); 0 in real runs.
    decode_delay_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DriverConfig:
    run: RunConfig = field(default_factory=RunConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    policy: ModelConfig = field(default_factory=ModelConfig)
    critic: ModelConfig = field(default_factory=lambda: ModelConfig(lr=3e-3))
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    # ------------------------------------------------------------- derived values
    @property
    def batch_groups(self) -> int:
        return self.ppo.num_prompts_per_step

    @property
    def min_groups(self) -> int:
        return self.async_rl.min_groups_for_streaming_train

    @property
    def streaming(self) -> bool:
        """True when the readiness minimum is below the batch (streaming rules apply)."""
        return self.min_groups < self.batch_groups

    @property
    def samples_per_step(self) -> int:
        return self.ppo.num_prompts_per_step * self.ppo.num_generations_per_prompt

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class ConfigProblem:
    """One configuration problem: the key, the value, what is wrong and how to fix it."""

    key: str
    value: Any
    message: str
    fix: str
    severity: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}={self.value!r}: {self.message}; fix: {self.fix}"


class ConfigError(ValueError):
    """Raised with EVERY problem found, not only the first."""

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = list(problems)
        lines = [f"{len(self.problems)} configuration problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


@dataclass
class ValidationReport:
    errors: list[ConfigProblem] = field(default_factory=list)
    warnings: list[ConfigProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_if_errors(self) -> None:
        if self.errors:
            raise ConfigError(self.errors)


# --------------------------------------------------------------------------- loading

T = TypeVar("T")


def default_config_path() -> Path:
    """The default YAML shipped inside the package (the built-in tiny task)."""
    return Path(str(resources.files("ppo_driver").joinpath("configs/default.yaml")))


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def apply_overrides(
    tree: dict[str, Any], overrides: Iterable[str], problems: list[ConfigProblem]
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars) to ``tree`` in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key or any(not p for p in key.split(".")):
            problems.append(
                ConfigProblem(
                    key=key or item,
                    value=item,
                    message="an override must look like section.key=value",
                    fix="write it as e.g. ppo.num_prompts_per_step=256",
                )
            )
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str, problems: list[ConfigProblem]) -> Any:
    """Check ``value`` against the annotation ``tp``; record a problem and return None if bad."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        sub: list[ConfigProblem] = []
        for candidate in inner:
            sub.clear()
            out = _coerce(candidate, value, key, sub)
            if not sub:
                return out
        problems.append(
            ConfigProblem(
                key,
                value,
                f"expected {' or '.join(_type_name(a) for a in args)}",
                f"set {key} to a value of that type",
            )
        )
        return None
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    problems.append(
        ConfigProblem(
            key,
            value,
            f"expected {_type_name(tp)}, got {type(value).__name__}",
            f"set {key} to a {_type_name(tp)}",
        )
    )
    return None


def _build(cls: type[T], data: Mapping[str, Any], prefix: str, problems: list[ConfigProblem]) -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (
                f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(names)}"
            )
            problems.append(ConfigProblem(dotted, value, "unknown key", f"remove it ({hint})"))
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(
                    ConfigProblem(
                        dotted, value, "expected a section (mapping)", f"write {dotted}: {{...}}"
                    )
                )
                continue
            kwargs[key] = _build(tp, value, f"{dotted}.", problems)  # type: ignore[arg-type]
            continue
        before = len(problems)
        out = _coerce(tp, value, dotted, problems)
        if len(problems) == before:
            kwargs[key] = out
    return cls(**kwargs)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    check: bool = True,
) -> tuple[DriverConfig, ValidationReport]:
    """Read YAML (the shipped default when ``path`` is None), apply overrides, validate.

    Returns the config and a report holding every error and warning. With ``check``
    (the default) a report with errors raises :class:`ConfigError` listing all of them.
    """
    problems: list[ConfigProblem] = []
    src = Path(path) if path is not None else default_config_path()
    try:
        loaded = yaml.safe_load(src.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "--config",
                    str(src),
                    f"cannot read the YAML file ({exc})",
                    "pass a readable YAML file",
                )
            ]
        ) from exc
    if not isinstance(loaded, dict):
        raise ConfigError(
            [
                ConfigProblem(
                    "--config",
                    str(src),
                    "the file is not a YAML mapping",
                    "write sections like `ppo: {...}`",
                )
            ]
        )
    apply_overrides(loaded, overrides, problems)
    cfg = _build(DriverConfig, loaded, "", problems)
    report = validate(cfg)
    report.errors[:0] = problems
    if check:
        report.raise_if_errors()
    return cfg, report


# --------------------------------------------------------------------------- rules


def _alignment(cfg: DriverConfig) -> int:
    from ppo_sampler import group_alignment

    return int(
        group_alignment(
            generations_per_prompt=cfg.ppo.num_generations_per_prompt,
            actor_dp=cfg.cluster.actor_gpus,
            critic_dp=cfg.cluster.actor_gpus,
            actor_micro_batch=cfg.policy.train_micro_batch_size,
            critic_micro_batch=cfg.critic.train_micro_batch_size,
        )
    )


def _check_positive(
    report: ValidationReport, key: str, value: float | int, *, allow_zero: bool = False
) -> bool:
    bad = value < 0 if allow_zero else value <= 0
    if bad:
        bound = ">= 0" if allow_zero else ">= 1" if isinstance(value, int) else "> 0"
        report.errors.append(ConfigProblem(key, value, f"must be {bound}", f"set {key} {bound}"))
        return False
    return True


def validate(cfg: DriverConfig) -> ValidationReport:
    """Every rule of the streaming document and the shared actor/critic report.

    Returns all problems at once (errors and warnings); never raises.
    """
    r = ValidationReport()
    ppo, arl = cfg.ppo, cfg.async_rl
    batch, minimum = ppo.num_prompts_per_step, arl.min_groups_for_streaming_train

    # basic ranges ------------------------------------------------------------
    counts_ok = _check_positive(r, "ppo.num_prompts_per_step", batch)
    counts_ok &= _check_positive(
        r, "ppo.num_generations_per_prompt", ppo.num_generations_per_prompt
    )
    counts_ok &= _check_positive(r, "async_rl.min_groups_for_streaming_train", minimum)
    _check_positive(r, "ppo.ppo_epochs", ppo.ppo_epochs)
    _check_positive(r, "ppo.critic_ppo_epochs", ppo.critic_ppo_epochs)
    _check_positive(r, "ppo.critic_mini_batch_size", ppo.critic_mini_batch_size)
    _check_positive(r, "ppo.critic_warmup_steps", ppo.critic_warmup_steps, allow_zero=True)
    _check_positive(r, "run.num_steps", cfg.run.num_steps)
    _check_positive(r, "run.checkpoint_every", cfg.run.checkpoint_every, allow_zero=True)
    _check_positive(r, "run.keep_checkpoints", cfg.run.keep_checkpoints)
    _check_positive(
        r,
        "async_rl.sampler.max_lookahead_versions",
        arl.sampler.max_lookahead_versions,
        allow_zero=True,
    )
    _check_positive(
        r,
        "async_rl.sampler.max_staleness_versions",
        arl.sampler.max_staleness_versions,
        allow_zero=True,
    )
    _check_positive(r, "async_rl.max_prompts_in_flight", arl.max_prompts_in_flight, allow_zero=True)
    _check_positive(r, "rollout.max_new_tokens", cfg.rollout.max_new_tokens)
    _check_positive(r, "rollout.num_engines", cfg.rollout.num_engines)
    _check_positive(r, "rollout.decode_delay_s", cfg.rollout.decode_delay_s, allow_zero=True)
    _check_positive(r, "ppo.eps_clip", ppo.eps_clip)
    for key, val in (
        ("ppo.adv_estimator.gamma", ppo.adv_estimator.gamma),
        ("ppo.adv_estimator.lam", ppo.adv_estimator.lam),
    ):
        if not 0.0 <= val <= 1.0:
            r.errors.append(
                ConfigProblem(key, val, "must lie in [0, 1]", f"set {key} between 0 and 1")
            )
    if ppo.loss_agg not in ("token", "sample"):
        r.errors.append(
            ConfigProblem(
                "ppo.loss_agg", ppo.loss_agg, "unknown loss aggregation", "use token or sample"
            )
        )
    if ppo.kl_estimator not in ("k1", "k2", "k3"):
        r.errors.append(
            ConfigProblem(
                "ppo.kl_estimator", ppo.kl_estimator, "unknown KL estimator", "use k1, k2 or k3"
            )
        )
    if ppo.kl_loss_coef < 0:
        r.errors.append(
            ConfigProblem(
                "ppo.kl_loss_coef", ppo.kl_loss_coef, "must be >= 0", "set ppo.kl_loss_coef >= 0"
            )
        )
    for role in ("policy", "critic"):
        m: ModelConfig = getattr(cfg, role)
        _check_positive(r, f"{role}.lr", m.lr)
        if m.train_micro_batch_size is not None:
            _check_positive(r, f"{role}.train_micro_batch_size", m.train_micro_batch_size)
    _check_positive(r, "cluster.actor_gpus", cfg.cluster.actor_gpus)
    _check_positive(r, "cluster.rollout_gpus", cfg.cluster.rollout_gpus, allow_zero=True)

    # reward-level KL in shared actor/critic mode (PR report) -----------------
    if ppo.kl_coef != 0:
        r.errors.append(
            ConfigProblem(
                "ppo.kl_coef",
                ppo.kl_coef,
                "reward-level KL (folded into GAE rewards) is not supported when actor and critic share "
                "devices: the critic cannot fold the actor's log-probs into its targets",
                "set ppo.kl_coef=0 and use the KL loss instead (ppo.kl_loss_coef > 0)",
            )
        )

    # sampler ------------------------------------------------------------------
    if arl.sampler.name not in SAMPLER_NAMES:
        r.errors.append(
            ConfigProblem(
                "async_rl.sampler.name",
                arl.sampler.name,
                f"unknown sampler (known: {', '.join(SAMPLER_NAMES)})",
                "set async_rl.sampler.name to in_order or ready_first",
            )
        )

    # Megatron: classic DDP only, no MXFP8 params with the distributed optimizer -
    for role in ("policy", "critic"):
        mc: MegatronCfg = getattr(cfg, role).megatron_cfg
        if mc.use_megatron_fsdp:
            r.errors.append(
                ConfigProblem(
                    f"{role}.megatron_cfg.use_megatron_fsdp",
                    True,
                    "Megatron FSDP is not supported: shared actor/critic offload needs classic DDP "
                    "gradient buffers that stay resident while parameters leave the device",
                    f"set {role}.megatron_cfg.use_megatron_fsdp=false (classic Megatron DDP)",
                )
            )
        mxfp8 = mc.fp8_param and (mc.fp8_recipe or "").lower() == "mxfp8"
        if mxfp8 and mc.optimizer.use_distributed_optimizer:
            r.errors.append(
                ConfigProblem(
                    f"{role}.megatron_cfg.optimizer.use_distributed_optimizer",
                    True,
                    "MXFP8 parameters (fp8_param with fp8_recipe=mxfp8) share parameter and gradient "
                    "storage under the distributed optimizer, so offloading parameters cannot keep "
                    "gradients resident (regardless of overlap_param_gather)",
                    f"set {role}.megatron_cfg.optimizer.use_distributed_optimizer=false or drop MXFP8 parameters "
                    f"({role}.megatron_cfg.fp8_param=false)",
                )
            )
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            _check_positive(r, f"{role}.megatron_cfg.{key}", getattr(mc, key))
    if cfg.policy.megatron_cfg.enabled != cfg.critic.megatron_cfg.enabled:
        r.errors.append(
            ConfigProblem(
                "critic.megatron_cfg.enabled",
                cfg.critic.megatron_cfg.enabled,
                "actor and critic must use the same backend and parallel layout (they share ranks)",
                f"set critic.megatron_cfg.enabled={str(cfg.policy.megatron_cfg.enabled).lower()}",
            )
        )

    # readiness minimum, full-batch vs streaming ------------------------------
    if not counts_ok:
        return r
    if minimum > batch:
        r.errors.append(
            ConfigProblem(
                "async_rl.min_groups_for_streaming_train",
                minimum,
                f"the minimum exceeds the batch (ppo.num_prompts_per_step={batch}), so no chunk could ever start",
                f"set it between 1 and {batch} ({batch} selects full-batch mode)",
            )
        )
        return r
    streaming = minimum < batch
    if streaming:
        why = f"streaming is on (async_rl.min_groups_for_streaming_train={minimum} < ppo.num_prompts_per_step={batch})"
        if ppo.ppo_epochs != 1:
            r.errors.append(
                ConfigProblem(
                    "ppo.ppo_epochs",
                    ppo.ppo_epochs,
                    f"{why} and streaming allows exactly one policy epoch",
                    f"set ppo.ppo_epochs=1, or async_rl.min_groups_for_streaming_train={batch} for full-batch mode",
                )
            )
        if arl.sampler.name in SAMPLER_NAMES and arl.sampler.name not in STREAMING_SAMPLERS:
            r.errors.append(
                ConfigProblem(
                    "async_rl.sampler.name",
                    arl.sampler.name,
                    f"{why}; streaming needs an in_order or ready_first sampler",
                    "set async_rl.sampler.name=in_order (or ready_first)",
                )
            )
        streaming_layout_problem = _streaming_layout_problem(cfg)
        if streaming_layout_problem is not None:
            r.errors.append(
                ConfigProblem(
                    "cluster.colocate",
                    cfg.cluster.colocate,
                    f"{why}; streaming needs generation on its own devices ({streaming_layout_problem})",
                    "set cluster.colocate=false and cluster.rollout_gpus >= 1, "
                    f"or async_rl.min_groups_for_streaming_train={batch} for full-batch mode",
                )
            )

    # alignment: both models' DP and micro-batch ------------------------------
    try:
        align = _alignment(cfg)
    except ValueError as exc:
        r.errors.append(
            ConfigProblem(
                "cluster.actor_gpus",
                cfg.cluster.actor_gpus,
                f"cannot compute group alignment ({exc})",
                "fix the data-parallel sizes and micro-batch sizes",
            )
        )
        return r
    for key, val in (
        ("ppo.num_prompts_per_step", batch),
        ("async_rl.min_groups_for_streaming_train", minimum),
    ):
        if val % align:
            lo = max(align, val - val % align)
            r.errors.append(
                ConfigProblem(
                    key,
                    val,
                    f"not a multiple of the group alignment {align} (the groups whose samples split evenly over "
                    f"actor and critic data-parallel ranks ({cfg.cluster.actor_gpus}) and micro-batches "
                    f"(policy {cfg.policy.train_micro_batch_size}, critic {cfg.critic.train_micro_batch_size}) "
                    f"with {ppo.num_generations_per_prompt} generations per prompt)",
                    f"set {key} to a multiple of {align}, e.g. {lo} or {lo + align}",
                )
            )
    if streaming and batch % align == 0 and minimum % align == 0:
        from ppo_sampler import single_chunk_only

        if single_chunk_only(batch=batch, min_groups=minimum, alignment=align):
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
    return r


def _streaming_layout_problem(cfg: DriverConfig) -> str | None:
    """Ask ppo_placement whether the rollout layout allows streaming; None when it does."""
    from ppo_placement import check_streaming_layout, placement_layout

    try:
        layout = placement_layout(
            actor_gpus=cfg.cluster.actor_gpus,
            rollout_gpus=cfg.cluster.rollout_gpus,
            colocate=cfg.cluster.colocate,
        )
        check_streaming_layout(layout, streaming=True)
    except ValueError as exc:
        return str(exc)
    return None
