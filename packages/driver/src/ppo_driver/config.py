"""Typed driver configuration: YAML plus dotted overrides, and start-up validation.

The key names follow ``reference/colocated-ppo-streaming.md`` (``ppo.*``, ``async_rl.*``,
``policy.megatron_cfg.*``). Loading never raises on the first problem: every unknown
key, every wrong type and every broken rule is collected, so ``ppo-driver validate``
can report them all at once. Each problem names the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from ppo_placement import SharedPlacement, check_streaming_layout, placement_layout
from ppo_sampler import group_alignment, single_chunk_only

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
    num_steps: int = 200
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
    # 0: each step's generation starts after the previous update and refit (see the
    # README: on the 2-core CPU task this is what leaves streaming a tail to overlap).
    max_lookahead_versions: int = 0
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
    lr: float = 2e-3
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
    # A reward call that takes longer fails its group (0: no limit).
    reward_timeout_s: float = 60.0
    # The run stops with the first failure's traceback when this many groups fail in a
    # row (reward raised, timed out, or returned something that is not a real number).
    max_consecutive_group_failures: int = 32
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
    def group_alignment(self) -> int:
        """Batch and minimum must be multiples of this (both models' data-parallel and
        micro-batch sizes; ``ppo_sampler.group_alignment``). ``ValueError`` if impossible."""
        return int(
            group_alignment(
                generations_per_prompt=self.ppo.num_generations_per_prompt,
                actor_dp=self.cluster.actor_gpus,
                critic_dp=self.cluster.actor_gpus,
                actor_micro_batch=self.policy.train_micro_batch_size,
                critic_micro_batch=self.critic.train_micro_batch_size,
            )
        )

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


def _non_finite_problem(key: str, value: Any) -> ConfigProblem:
    return ConfigProblem(
        key,
        value,
        "must be a finite number (NaN and infinity are refused)",
        f"set {key} to a finite number",
    )


def _coerce(tp: Any, value: Any, key: str, problems: list[ConfigProblem]) -> Any:
    """Check ``value`` against the annotation ``tp``; record a problem and return None if bad.

    Floats must be finite: NaN and infinity are refused here, for every float key of the
    schema (no range rule downstream has to think about them).
    """
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
        if len(inner) == 1 and sub:  # `float | None`: the float's own problem, null allowed
            only = sub[0]
            problems.append(dataclasses.replace(only, fix=f"{only.fix}, or null"))
            return None
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
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "2e-4" (and "nan", "inf") as strings
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is not None:
            if math.isfinite(number):
                return number
            problems.append(_non_finite_problem(key, value))
            return None
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


def _file_problem(src: Path, message: str, fix: str) -> ConfigError:
    return ConfigError([ConfigProblem("--config", str(src), message, fix)])


def _read_yaml(src: Path) -> dict[str, Any]:
    """The top-level mapping of the YAML file ``src`` (empty file: ``{}``).

    Raises :class:`ConfigError` naming the file for anything that is not a readable,
    UTF-8, YAML mapping, never a raw ``UnicodeDecodeError`` or ``YAMLError``.
    """
    try:
        text = src.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise _file_problem(
            src, f"the config file {src} does not exist", "check the path given to --config"
        ) from exc
    except IsADirectoryError as exc:
        raise _file_problem(
            src, f"{src} is a directory, not a YAML file", "pass the YAML file itself to --config"
        ) from exc
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        raise _file_problem(
            src,
            f"the config file {src} is not UTF-8 text (byte 0x{byte} at offset {exc.start})",
            "save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 old.yaml > new.yaml`)",
        ) from exc
    except OSError as exc:
        raise _file_problem(
            src,
            f"cannot read the config file {src} ({exc.strerror or exc})",
            "make it readable (permissions) or pass another file to --config",
        ) from exc
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise _file_problem(
            src,
            f"the config file {src} is not valid YAML ({where}{what})",
            "fix the YAML syntax at the line and column shown",
        ) from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise _file_problem(
            src,
            f"the config file {src} holds a YAML {type(loaded).__name__}, not a mapping "
            "of sections",
            "write sections at the top level, e.g. `ppo:` and under it "
            "`  num_prompts_per_step: 16`",
        )
    return loaded


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    check: bool = True,
) -> tuple[DriverConfig, ValidationReport]:
    """Read YAML (the shipped default when ``path`` is None), apply overrides, validate.

    Keys the YAML leaves out take the dataclass defaults (the shipped ``default.yaml``
    lists exactly those, so an empty file and the default file give the same config).
    Returns the config and a report holding every error and warning. With ``check``
    (the default) a report with errors raises :class:`ConfigError` listing all of them.
    A file that cannot be read as a YAML mapping raises :class:`ConfigError` in any case.
    """
    problems: list[ConfigProblem] = []
    src = Path(path) if path is not None else default_config_path()
    loaded = _read_yaml(src)
    apply_overrides(loaded, overrides, problems)
    cfg = _build(DriverConfig, loaded, "", problems)
    report = validate(cfg)
    # A key the coercion step refused kept its default; validate() saw that default.
    report.errors[:0] = problems
    if check:
        report.raise_if_errors()
    return cfg, report


# --------------------------------------------------------------------------- rules

ROLES = ("policy", "critic")
MEGATRON_EXTRA = "ppo-trainer[megatron]"
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""megatron-core's FP8 recipes the trainer can build (``custom`` needs a quantizer
factory it does not pass); ``fp8_recipe: null`` means ``delayed``."""

_PPO_KEYS = frozenset(f.name for f in dataclasses.fields(PPOConfig))
_TRAINER_RENAMES = {"micro_batch_size": "train_micro_batch_size"}
_TRAINER_KEY = re.compile(r"([A-Za-z_][\w.]*)(?:=(.*?) is |\s)")


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


def validate(cfg: DriverConfig) -> ValidationReport:
    """Every value the trainer, the sampler, the placement or the engines would refuse.

    Covers the rules of the streaming document and the shared actor/critic report, the
    trainer's config and Megatron checks, the placement layout, the model / data files
    and the reward function (imported here). Runs before Ray starts and returns all
    problems at once (errors and warnings); never raises.
    """
    r = ValidationReport()
    r.errors.extend(_non_finite_problem(key, value) for key, value in _non_finite(cfg))
    counts_ok = _check_ranges(r, cfg)
    _check_rules(r, cfg)
    _check_megatron(r, cfg)
    _check_batch(r, cfg, counts_ok=counts_ok)
    _check_layout(r, cfg, streaming=counts_ok and cfg.streaming)
    _check_files(r, cfg)
    _check_reward(r, cfg)
    _check_with_trainer(r, cfg)
    return r


def _check_ranges(r: ValidationReport, cfg: DriverConfig) -> bool:
    """Ranges of single values; returns whether the batch counts are usable."""
    ppo, arl, ro = cfg.ppo, cfg.async_rl, cfg.rollout
    counts_ok = _check_positive(r, "ppo.num_prompts_per_step", ppo.num_prompts_per_step)
    counts_ok &= _check_positive(
        r, "ppo.num_generations_per_prompt", ppo.num_generations_per_prompt
    )
    counts_ok &= _check_positive(
        r, "async_rl.min_groups_for_streaming_train", arl.min_groups_for_streaming_train
    )
    for key, count in (
        ("ppo.ppo_epochs", ppo.ppo_epochs),
        ("ppo.critic_ppo_epochs", ppo.critic_ppo_epochs),
        ("ppo.critic_mini_batch_size", ppo.critic_mini_batch_size),
        ("run.num_steps", cfg.run.num_steps),
        ("run.keep_checkpoints", cfg.run.keep_checkpoints),
        ("rollout.max_new_tokens", ro.max_new_tokens),
        ("rollout.num_engines", ro.num_engines),
        ("rollout.max_consecutive_group_failures", ro.max_consecutive_group_failures),
        ("cluster.actor_gpus", cfg.cluster.actor_gpus),
    ):
        _check_positive(r, key, count)
    for key, amount in (
        ("ppo.critic_warmup_steps", ppo.critic_warmup_steps),
        ("run.checkpoint_every", cfg.run.checkpoint_every),
        ("async_rl.sampler.max_lookahead_versions", arl.sampler.max_lookahead_versions),
        ("async_rl.sampler.max_staleness_versions", arl.sampler.max_staleness_versions),
        ("async_rl.max_prompts_in_flight", arl.max_prompts_in_flight),
        ("rollout.decode_delay_s", ro.decode_delay_s),
        ("rollout.reward_timeout_s", ro.reward_timeout_s),
        ("ppo.kl_loss_coef", ppo.kl_loss_coef),
        ("ppo.entropy_coef", ppo.entropy_coef),
        ("cluster.rollout_gpus", cfg.cluster.rollout_gpus),
    ):
        _check_positive(r, key, amount, allow_zero=True)
    _check_positive(r, "async_rl.poll_interval_s", arl.poll_interval_s)
    if cfg.cluster.num_cpus is not None:
        _check_positive(r, "cluster.num_cpus", cfg.cluster.num_cpus)

    # PPO loss constants: what ppo_trainer.ActorConfig / CriticConfig accept
    _need(r, "ppo.eps_clip", ppo.eps_clip, 0.0 < ppo.eps_clip < 1.0, "in (0, 1)", 0.2)
    if ppo.eps_clip_high is not None:
        _need(r, "ppo.eps_clip_high", ppo.eps_clip_high, ppo.eps_clip_high > 0, "> 0 or null")
    if ppo.dual_clip is not None:
        _need(r, "ppo.dual_clip", ppo.dual_clip, ppo.dual_clip > 1.0, "> 1 or null", 3.0)
    if ppo.value_clip is not None:
        _need(r, "ppo.value_clip", ppo.value_clip, ppo.value_clip > 0, "> 0 or null", 0.2)
    for key, val in (
        ("ppo.adv_estimator.gamma", ppo.adv_estimator.gamma),
        ("ppo.adv_estimator.lam", ppo.adv_estimator.lam),
    ):
        _need(r, key, val, 0.0 <= val <= 1.0, "in [0, 1]")
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

    # generation: what the engines' SamplingParams accept (temperature 0 is greedy)
    _need(r, "rollout.temperature", ro.temperature, ro.temperature >= 0, ">= 0 (0: greedy)")
    _need(r, "rollout.top_p", ro.top_p, 0.0 < ro.top_p <= 1.0, "in (0, 1]", 1.0)
    if "max_count" in ro.extra:  # the built-in task's largest count (synthetic_records)
        count = ro.extra["max_count"]
        ok = isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= 99
        _need(r, "rollout.extra.max_count", count, ok, "an integer in [1, 99]", 8)

    for role in ROLES:
        _check_model_ranges(r, role, getattr(cfg, role))
    return counts_ok


def _check_model_ranges(r: ValidationReport, role: str, m: ModelConfig) -> None:
    """The optimizer settings (ppo_trainer's _TrainConfig) and the model shape (ModelSpec)."""
    _check_positive(r, f"{role}.lr", m.lr)
    _check_positive(r, f"{role}.weight_decay", m.weight_decay, allow_zero=True)
    _check_positive(r, f"{role}.max_grad_norm", m.max_grad_norm)
    _check_positive(r, f"{role}.warmup_steps", m.warmup_steps, allow_zero=True)
    if m.train_micro_batch_size is not None:
        _check_positive(r, f"{role}.train_micro_batch_size", m.train_micro_batch_size)
    sizes_ok = True
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        sizes_ok &= _check_positive(r, f"{role}.{name}", getattr(m, name))
    if not sizes_ok:
        return
    heads, kv = m.num_attention_heads, m.num_key_value_heads
    if m.hidden_size % heads:
        r.errors.append(
            ConfigProblem(
                f"{role}.hidden_size",
                m.hidden_size,
                f"must be divisible by {role}.num_attention_heads={heads}",
                f"set {role}.hidden_size to a multiple of {heads}, e.g. "
                f"{max(heads, m.hidden_size - m.hidden_size % heads)}",
            )
        )
    if heads % kv:
        r.errors.append(
            ConfigProblem(
                f"{role}.num_key_value_heads",
                kv,
                f"must divide {role}.num_attention_heads={heads} (grouped-query attention)",
                f"set {role}.num_key_value_heads to a divisor of {heads}, e.g. "
                f"{math.gcd(heads, kv)}",
            )
        )


def _check_rules(r: ValidationReport, cfg: DriverConfig) -> None:
    """Reward-level KL (shared actor/critic report) and the sampler's name."""
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
    if cfg.async_rl.sampler.name not in SAMPLER_NAMES:
        r.errors.append(
            ConfigProblem(
                "async_rl.sampler.name",
                cfg.async_rl.sampler.name,
                f"unknown sampler (known: {', '.join(SAMPLER_NAMES)})",
                "set async_rl.sampler.name to in_order or ready_first",
            )
        )


# --------------------------------------------------------------------------- Megatron


def _check_megatron(r: ValidationReport, cfg: DriverConfig) -> None:
    """Classic DDP only, no MXFP8 parameters with the distributed optimizer (document);
    what megatron-core and the trainer's Megatron backend refuse; one layout for both."""
    for role in ROLES:
        mc: MegatronCfg = getattr(cfg, role).megatron_cfg
        p = f"{role}.megatron_cfg"
        if mc.use_megatron_fsdp:
            r.errors.append(
                ConfigProblem(
                    f"{p}.use_megatron_fsdp",
                    True,
                    "Megatron FSDP is not supported: shared actor/critic offload needs classic DDP "
                    "gradient buffers that stay resident while parameters leave the device",
                    f"set {p}.use_megatron_fsdp=false (classic Megatron DDP)",
                )
            )
        mxfp8 = mc.fp8_param and (mc.fp8_recipe or "").lower() == "mxfp8"
        if mxfp8 and mc.optimizer.use_distributed_optimizer:
            r.errors.append(
                ConfigProblem(
                    f"{p}.optimizer.use_distributed_optimizer",
                    True,
                    "MXFP8 parameters (fp8_param with fp8_recipe=mxfp8) share parameter and gradient "
                    "storage under the distributed optimizer, so offloading parameters cannot keep "
                    "gradients resident (regardless of overlap_param_gather)",
                    f"set {p}.optimizer.use_distributed_optimizer=false or drop MXFP8 parameters "
                    f"({p}.fp8_param=false)",
                )
            )
        if mc.optimizer.overlap_param_gather and not mc.optimizer.use_distributed_optimizer:
            r.errors.append(
                ConfigProblem(
                    f"{p}.optimizer.overlap_param_gather",
                    True,
                    "the parameter all-gather it overlaps exists only with the distributed "
                    "optimizer (megatron-core silently ignores it otherwise; Megatron-LM "
                    "refuses the combination)",
                    f"set {p}.optimizer.overlap_param_gather=false, or "
                    f"{p}.optimizer.use_distributed_optimizer=true",
                )
            )
        elif mc.optimizer.overlap_param_gather and mc.enabled:
            r.warnings.append(
                ConfigProblem(
                    f"{p}.optimizer.overlap_param_gather",
                    True,
                    "the trainer runs the distributed optimizer's parameter all-gather "
                    "synchronously (its offload between chunks needs the gathered parameters "
                    "in place), so this has no effect",
                    f"remove {p}.optimizer.overlap_param_gather",
                    severity="warning",
                )
            )
        if mc.fp8_recipe is not None and mc.fp8_recipe.lower() not in FP8_RECIPES:
            r.errors.append(
                ConfigProblem(
                    f"{p}.fp8_recipe",
                    mc.fp8_recipe,
                    "unknown FP8 recipe",
                    f"use one of {', '.join(FP8_RECIPES)} (null: delayed)",
                )
            )
        elif mc.fp8_recipe is not None and not mc.fp8_param:
            r.warnings.append(
                ConfigProblem(
                    f"{p}.fp8_recipe",
                    mc.fp8_recipe,
                    f"has no effect while {p}.fp8_param is false",
                    f"set {p}.fp8_param=true for FP8 parameters, or remove {p}.fp8_recipe",
                    severity="warning",
                )
            )
        sizes_ok = _check_positive(
            r, f"{p}.tensor_model_parallel_size", mc.tensor_model_parallel_size
        )
        sizes_ok &= _check_positive(
            r, f"{p}.pipeline_model_parallel_size", mc.pipeline_model_parallel_size
        )
        if mc.enabled and sizes_ok:
            _check_megatron_layout(r, cfg, role)

    policy, critic = cfg.policy.megatron_cfg, cfg.critic.megatron_cfg
    if policy.enabled != critic.enabled:
        r.errors.append(
            ConfigProblem(
                "critic.megatron_cfg.enabled",
                critic.enabled,
                "actor and critic must use the same backend and parallel layout (they share ranks)",
                f"set critic.megatron_cfg.enabled={str(policy.enabled).lower()}",
            )
        )
    elif policy.enabled:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            mine, theirs = getattr(critic, name), getattr(policy, name)
            if mine != theirs:
                r.errors.append(
                    ConfigProblem(
                        f"critic.megatron_cfg.{name}",
                        mine,
                        f"actor and critic must use the same parallel layout (policy has "
                        f"{theirs}): the critic reuses the actor's placement bundles, critic "
                        "rank r runs beside actor rank r and hands it its values",
                        f"set critic.megatron_cfg.{name}={theirs}",
                    )
                )
    if policy.enabled or critic.enabled:
        _check_megatron_install(r, cfg)


@dataclass(frozen=True)
class _Shape:
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    source: str


def _model_shape(cfg: DriverConfig, role: str) -> _Shape | None:
    """The head / layer / vocabulary counts the trainer builds ``role`` with: the
    checkpoint's config.json with a model_path, else the tiny model of the config."""
    m: ModelConfig = getattr(cfg, role)
    if m.model_path is None:
        return _Shape(
            m.num_attention_heads,
            m.num_key_value_heads,
            m.num_hidden_layers,
            _builtin_vocab_size(),
            f"the {role}.* model sizes and the built-in task's vocabulary",
        )
    path = Path(m.model_path) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
        heads = int(hf["num_attention_heads"])
        return _Shape(
            heads,
            int(hf.get("num_key_value_heads") or heads),
            int(hf["num_hidden_layers"]),
            int(hf["vocab_size"]),
            str(path),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # reported by _check_files


def _check_megatron_layout(r: ValidationReport, cfg: DriverConfig, role: str) -> None:
    """What megatron's parallel_state and the trainer's transformer config refuse."""
    mc: MegatronCfg = getattr(cfg, role).megatron_cfg
    p = f"{role}.megatron_cfg"
    tp, pp, gpus = (
        mc.tensor_model_parallel_size,
        mc.pipeline_model_parallel_size,
        cfg.cluster.actor_gpus,
    )
    tp_key, pp_key = f"{p}.tensor_model_parallel_size", f"{p}.pipeline_model_parallel_size"
    if gpus >= 1 and gpus % (tp * pp):
        r.errors.append(
            ConfigProblem(
                tp_key if tp > 1 else pp_key,
                tp if tp > 1 else pp,
                f"tensor x pipeline parallel = {tp} x {pp} = {tp * pp} ranks per model "
                f"replica, which does not divide cluster.actor_gpus={gpus} (data parallel = "
                "cluster.actor_gpus / (tensor x pipeline))",
                f"choose {p}.tensor_model_parallel_size and pipeline_model_parallel_size whose "
                f"product divides {gpus}, or set cluster.actor_gpus to a multiple of {tp * pp}",
            )
        )
    shape = _model_shape(cfg, role)
    if shape is None:
        return
    counts = (
        ("attention heads", shape.heads),
        ("key/value heads", shape.kv_heads),
        ("vocabulary size", shape.vocab),
    )
    bad = [f"{what} ({n})" for what, n in counts if n % tp]
    if bad:
        common = math.gcd(*(n for _, n in counts))
        r.errors.append(
            ConfigProblem(
                tp_key,
                tp,
                f"must divide the model's {' and '.join(bad)} (from {shape.source})",
                f"set {tp_key} to a common divisor of them (their greatest is {common})",
            )
        )
    if shape.layers % pp:
        r.errors.append(
            ConfigProblem(
                pp_key,
                pp,
                f"must divide the model's {shape.layers} layers (from {shape.source})",
                f"set {pp_key} to a divisor of {shape.layers}",
            )
        )


def _megatron_import_error() -> str | None:
    """Why the trainer's Megatron backend cannot be imported here (None: it can)."""
    from ppo_trainer import get_backend  # lazy: imports torch

    try:
        get_backend("megatron")
    except ImportError as exc:
        return str(exc).splitlines()[0]
    return None


def _check_megatron_install(r: ValidationReport, cfg: DriverConfig) -> None:
    """The optional dependencies an enabled Megatron backend needs, on this machine."""
    role = "policy" if cfg.policy.megatron_cfg.enabled else "critic"
    why = _megatron_import_error()
    if why is not None:
        r.errors.append(
            ConfigProblem(
                f"{role}.megatron_cfg.enabled",
                True,
                f"the Megatron backend cannot be imported ({why})",
                f"install the extra {MEGATRON_EXTRA} (in this workspace: "
                f"`uv sync --extra megatron`), or set {role}.megatron_cfg.enabled=false",
            )
        )
        return
    from ppo_trainer.megatron import transformer_engine_available  # lazy: imports megatron

    if transformer_engine_available():
        return
    for role in ROLES:
        mc: MegatronCfg = getattr(cfg, role).megatron_cfg
        if mc.enabled and mc.fp8_param:
            r.errors.append(
                ConfigProblem(
                    f"{role}.megatron_cfg.fp8_param",
                    True,
                    "FP8 parameters need the Transformer Engine layer spec, which needs CUDA "
                    "and the extra ppo-trainer[te]: not available on this machine",
                    f"install ppo-trainer[te] on a CUDA machine, or set "
                    f"{role}.megatron_cfg.fp8_param=false",
                )
            )


# --------------------------------------------------------------------------- batch, layout


def _streaming_why(cfg: DriverConfig) -> str:
    return (
        f"streaming is on (async_rl.min_groups_for_streaming_train={cfg.min_groups} < "
        f"ppo.num_prompts_per_step={cfg.batch_groups})"
    )


def _check_batch(r: ValidationReport, cfg: DriverConfig, *, counts_ok: bool) -> None:
    """Readiness minimum, what streaming needs, alignment (every problem, no early exit)."""
    ppo, sampler = cfg.ppo, cfg.async_rl.sampler
    batch, minimum = cfg.batch_groups, cfg.min_groups
    if not counts_ok:
        return
    if minimum > batch:
        r.errors.append(
            ConfigProblem(
                "async_rl.min_groups_for_streaming_train",
                minimum,
                f"the minimum exceeds the batch (ppo.num_prompts_per_step={batch}), so no chunk could ever start",
                f"set it between 1 and {batch} ({batch} selects full-batch mode)",
            )
        )
    streaming = minimum < batch
    if streaming and ppo.ppo_epochs != 1:
        r.errors.append(
            ConfigProblem(
                "ppo.ppo_epochs",
                ppo.ppo_epochs,
                f"{_streaming_why(cfg)} and streaming allows exactly one policy epoch",
                f"set ppo.ppo_epochs=1, or async_rl.min_groups_for_streaming_train={batch} for full-batch mode",
            )
        )
    if streaming and sampler.name in SAMPLER_NAMES and sampler.name not in STREAMING_SAMPLERS:
        r.errors.append(
            ConfigProblem(
                "async_rl.sampler.name",
                sampler.name,
                f"{_streaming_why(cfg)}; streaming needs an in_order or ready_first sampler",
                "set async_rl.sampler.name=in_order (or ready_first)",
            )
        )
    if cfg.cluster.actor_gpus >= 1:
        _check_alignment(r, cfg, streaming=streaming)


def _check_layout(r: ValidationReport, cfg: DriverConfig, *, streaming: bool) -> None:
    """The bundle layout ``train`` reserves, as ppo_placement judges it."""
    if cfg.cluster.actor_gpus < 1 or cfg.cluster.rollout_gpus < 0:
        return  # reported as ranges
    problem = _layout_problem(cfg, streaming=streaming)
    if problem is None:
        return
    if streaming:
        r.errors.append(
            ConfigProblem(
                "cluster.colocate",
                cfg.cluster.colocate,
                f"{_streaming_why(cfg)}; streaming needs generation on its own devices ({problem})",
                "set cluster.colocate=false and cluster.rollout_gpus >= 1, "
                f"or async_rl.min_groups_for_streaming_train={cfg.batch_groups} for full-batch mode",
            )
        )
        return
    name = "colocate"
    if problem.startswith(("actor_gpus=", "rollout_gpus=")):
        name = problem.split("=", 1)[0]
    r.errors.append(
        ConfigProblem(
            f"cluster.{name}",
            getattr(cfg.cluster, name),
            f"ppo_placement refuses the layout: {problem}",
            "give generation GPUs of its own (cluster.rollout_gpus >= 1), or let it "
            "share the training GPUs (cluster.colocate=true, full-batch mode only)",
        )
    )


def _check_alignment(r: ValidationReport, cfg: DriverConfig, *, streaming: bool) -> None:
    """Batch and minimum: multiples of both models' data-parallel and micro-batch sizes."""
    ppo = cfg.ppo
    batch, minimum = ppo.num_prompts_per_step, cfg.async_rl.min_groups_for_streaming_train
    try:
        align = cfg.group_alignment
    except ValueError as exc:
        r.errors.append(
            ConfigProblem(
                "cluster.actor_gpus",
                cfg.cluster.actor_gpus,
                f"cannot compute group alignment ({exc})",
                "fix the data-parallel sizes and micro-batch sizes",
            )
        )
        return
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
                    f"actor and critic data-parallel ranks ({cfg.cluster.actor_gpus}) and micro-batches "
                    f"(policy {cfg.policy.train_micro_batch_size}, critic {cfg.critic.train_micro_batch_size}) "
                    f"with {ppo.num_generations_per_prompt} generations per prompt)",
                    f"set {key} to a multiple of {align}, e.g. {lo} or {lo + align}",
                )
            )
    if (
        streaming
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


def _layout_problem(cfg: DriverConfig, *, streaming: bool) -> str | None:
    """What ppo_placement refuses about the layout ``train`` reserves; None when nothing."""
    try:
        layout = placement_layout(
            actor_gpus=cfg.cluster.actor_gpus,
            rollout_gpus=cfg.cluster.rollout_gpus,
            colocate=cfg.cluster.colocate,
        )
        SharedPlacement(layout)  # its bundle and share checks (pure until create())
        check_streaming_layout(layout, streaming=streaming)
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- files, reward


def _check_files(r: ValidationReport, cfg: DriverConfig) -> None:
    """Model directories (with config.json) and the prompt data set exist."""
    for role in ROLES:
        path = getattr(cfg, role).model_path
        if path is None:
            continue
        key = f"{role}.model_path"
        fix = (
            f"point {key} at a local Hugging Face model directory (config.json and "
            "*.safetensors), or remove it for the built-in tiny model"
        )
        model = Path(path)
        config = model / "config.json"
        if not model.exists():
            r.errors.append(ConfigProblem(key, path, f"{model} does not exist", fix))
        elif not model.is_dir():
            r.errors.append(ConfigProblem(key, path, f"{model} is not a directory", fix))
        elif not config.is_file():
            r.errors.append(ConfigProblem(key, path, f"{model} has no config.json", fix))
        else:
            try:
                hf = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                r.errors.append(
                    ConfigProblem(key, path, f"{config} is not readable JSON ({exc})", fix)
                )
                continue
            if not isinstance(hf, dict):
                r.errors.append(ConfigProblem(key, path, f"{config} is not a JSON object", fix))
    data = cfg.rollout.dataset_path
    if data is not None and not Path(data).is_file():
        state = "is not a file" if Path(data).exists() else "does not exist"
        r.errors.append(
            ConfigProblem(
                "rollout.dataset_path",
                data,
                f"the prompt data set {data} {state}",
                'point rollout.dataset_path at a JSONL file (one {"prompt": ...} object per '
                "line), or remove it for the built-in task",
            )
        )


def _check_reward(r: ValidationReport, cfg: DriverConfig) -> None:
    """Import the reward function as ``train`` will (ppo_driver.rollout.load_reward_fn)."""
    spec = cfg.rollout.reward
    if spec is None:
        return
    from ppo_driver.rollout import load_reward_fn  # lazy: imports torch

    fix = (
        "set rollout.reward to 'package.module:function', a callable "
        "reward_fn(*, response, record, finish_reason) -> float that imports here "
        "(check PYTHONPATH), or remove it for the built-in task's reward"
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


# --------------------------------------------------------------------------- the trainer's checks


def _builtin_vocab_size() -> int:
    """The vocabulary ``train`` gives the tiny model (its character tokenizer)."""
    from ppo_driver.rollout import CharTokenizer  # lazy: imports torch
    from ppo_driver.run import TASK_ALPHABET  # lazy: run imports this module

    return CharTokenizer(TASK_ALPHABET).vocab_size


def _check_with_trainer(r: ValidationReport, cfg: DriverConfig) -> None:
    """The trainer's own checks on the very configs ``train`` builds.

    Every rule above mirrors one of them so that all problems show at once; this net
    catches a rule the trainer gained later and any bug in the driver -> trainer mapping
    (``ppo_driver.run.build_trainer_configs``, the Megatron ``backend_options``).
    """
    from ppo_driver.run import build_trainer_configs  # lazy: run imports this module

    try:
        configs = build_trainer_configs(cfg, vocab_size=_builtin_vocab_size())
    except Exception as exc:
        # A consequence of a problem already reported (e.g. cluster.actor_gpus=0) is not
        # reported twice; the trainer's own ValueError always is (unless its key is).
        if isinstance(exc, ValueError) or not r.errors:
            _add_trainer_problem(r, cfg, exc, "ppo_trainer refuses it")
        return
    if not any(c.backend == "megatron" for c in configs) or _megatron_import_error():
        return
    from ppo_trainer.megatron import parse_options  # lazy: imports megatron-core

    for role, trainer_cfg in zip(ROLES, configs, strict=True):
        if trainer_cfg.backend != "megatron":
            continue
        try:
            parse_options(trainer_cfg.backend_options, role=role)
        except ValueError as exc:
            _add_trainer_problem(
                r,
                cfg,
                exc,
                f"the trainer's Megatron backend refuses the options the driver builds from "
                f"{role}.megatron_cfg",
            )


def _yaml_key(cfg: DriverConfig, trainer_key: str, value_text: str | None) -> str:
    """The YAML key behind a key the trainer names (``actor.lr`` -> ``policy.lr``)."""
    head, _, name = trainer_key.partition(".")
    if head in ("actor", "critic") and name in _PPO_KEYS:
        return f"ppo.{name}"
    if head in ("actor", "critic"):
        role = "policy" if head == "actor" else "critic"
        return f"{role}.{_TRAINER_RENAMES.get(name, name)}"
    if head == "model":  # ModelSpec: the policy's is built first
        ours = repr(getattr(cfg.policy, name, None))
        return f"policy.{name}" if value_text in (None, ours) else f"critic.{name}"
    return trainer_key


def _lookup(cfg: DriverConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    return node


def _add_trainer_problem(r: ValidationReport, cfg: DriverConfig, exc: Exception, who: str) -> None:
    text = " ".join(str(exc).split())
    match = _TRAINER_KEY.match(text)
    key = _yaml_key(cfg, match.group(1), match.group(2)) if match else "policy"
    if any(p.key == key for p in r.errors):
        return
    head, sep, tail = text.partition(": ")
    r.errors.append(
        ConfigProblem(
            key,
            _lookup(cfg, key),
            f"{who} ({head})" if sep else f"{who} ({type(exc).__name__}: {text})",
            tail if sep else "change the value the message names",
        )
    )
