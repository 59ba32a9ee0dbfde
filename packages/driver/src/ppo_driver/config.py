"""Typed driver configuration: YAML plus dotted overrides, and start-up validation.

The key names follow ``reference/colocated-ppo-streaming.md`` (``ppo.*``, ``async_rl.*``,
``policy.megatron_cfg.*``). Loading never raises on the first problem: every unknown
key, every wrong type and every broken rule is collected, so ``ppo-driver validate``
can report them all at once. Each problem names the key, the value and the fix.

The packages' typed configs are built HERE, once, from a :class:`DriverConfig`:
:func:`trainer_configs` (``ppo_trainer.ActorConfig`` / ``CriticConfig``, with the Megatron
``backend_options``), :func:`sampler_config` (``ppo_sampler.SamplerConfig``) and
:func:`cluster_layout` (``ppo_placement.Layout``). :func:`validate` asks the packages'
``problems`` for the very same field values and maps each refused field to its YAML key
by table; the driver itself only checks the keys no package reads and the rules that
span packages.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import json
import math
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import transformers
import yaml
from ppo_placement import (
    Layout,
    check_streaming_layout,
    cluster_address_problem,
    layout_problems,
    placement_layout,
    streaming_layout_problems,
)
from ppo_sampler import SamplerConfig, group_alignment, single_chunk_only
from ppo_trainer import (
    OFFLOAD_BACKENDS,
    ActorConfig,
    CriticConfig,
    ModelSpec,
    data_parallel_size,
    get_backend,
    memory_saver_problem,
    mesh_problems,
    option_problems,
)

__all__ = [
    "ADV_NORMALIZATIONS",
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
    "Role",
    "RolloutConfig",
    "RunConfig",
    "SamplerCfg",
    "ValidConfig",
    "ValidationReport",
    "apply_overrides",
    "cluster_layout",
    "default_config_path",
    "load_config",
    "model_path",
    "sampler_config",
    "trainer_configs",
    "validate",
    "validated",
]

Role = Literal["policy", "actor", "critic"]
"""A trained model: ``policy`` (its YAML section; ``actor`` is the same model) or ``critic``."""


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
    # Greedy evaluation of rollout.eval_dataset_path after every eval_every-th step (and
    # the last); eval/* in that step's metrics row. 0: off.
    eval_every: int = 0
    progress: bool = True
    # TensorBoard event files under <run dir>/tensorboard/ (every numeric metric), besides
    # metrics.jsonl and the console line; needs the extra ppo-driver[tensorboard].
    tensorboard: bool = False
    # Level of the project's loggers (ppo_driver, ppo_trainer, ppo_lifecycle, ...) in
    # train.log, the trainer worker processes' lines included: DEBUG, INFO, WARNING, ERROR.
    log_level: str = "INFO"


ADV_NORMALIZATIONS = ("previous_step", "chunk")


@dataclass
class AdvEstimatorConfig:
    normalize_advantages: bool = True
    # previous_step (the project's): every chunk of a step is whitened with the statistics
    # of the previous step's whole batch, fixed before the step starts (none yet: not
    # normalised), so a streamed step learns what a full-batch step learns.
    # chunk (the streaming document's): each chunk with its own statistics (full-batch:
    # the batch's), so the chunk boundaries change the gradients.
    normalization: str = "previous_step"
    gamma: float = 1.0
    lam: float = 0.95


@dataclass
class PPOConfig:
    num_prompts_per_step: int = 64
    num_generations_per_prompt: int = 4
    ppo_epochs: int = 4
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
    min_groups_for_streaming_train: int = 16
    # true: chunks cut at fixed positions of each step's dispatch order (bitwise reruns)
    deterministic_chunks: bool = False
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
    # auto: Transformer Engine's layer spec when TE imports and CUDA is present, else local
    transformer_impl: str = "auto"
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
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    train_micro_batch_size: int | None = None
    # auto | host_copy | memory_saver: how sleep moves the model off its device (auto:
    # memory_saver on CUDA with torch_memory_saver and the torch backend, else host_copy)
    offload_backend: str = "auto"
    # float32 | bfloat16: the weights' dtype (the engine's too). bfloat16 needs
    # megatron_cfg.enabled (bf16 compute, fp32 master weights in the optimizer)
    dtype: str = "float32"
    megatron_cfg: MegatronCfg = field(default_factory=MegatronCfg)


@dataclass
class ClusterConfig:
    """Devices: actor and critic share ``actor_gpus``; generation gets ``rollout_gpus``."""

    actor_gpus: int = 1
    rollout_gpus: int = 1
    colocate: bool = False
    # true: the local cluster declares the layout's GPUs as logical Ray resources (CPU
    # runs); false: it offers the machine's CUDA devices (validate checks there are enough)
    logical_gpus: bool = True
    num_cpus: int | None = None
    # null: start a local Ray cluster; "auto" or "host:port": join the existing cluster
    # (`ray start`) at that GCS address, and leave it running at the end.
    address: str | None = None


@dataclass
class RolloutConfig:
    # The prompts: null, the built-in task; else a JSONL file, one object per line with
    # a `prompt_key` field (every field reaches the reward as `record`).
    dataset_path: str | None = None
    prompt_key: str = "prompt"
    # The tokenizer's chat template around each prompt (a string, or a list of
    # {"role", "content"} messages); needs policy.model_path's tokenizer to have one.
    apply_chat_template: bool = False
    # Held-out prompts (JSONL, same prompt_key), evaluated every run.eval_every steps.
    eval_dataset_path: str | None = None
    reward: str | None = None
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    num_engines: int = 1
    # Seconds each decode step of the embedded engine takes at least (it sleeps what its
    # compute left): emulates a slower generation device on CPU (tests, what-if
    # benchmarks) whose speed does not depend on the trainers' load; 0 in real runs.
    decode_delay_s: float = 0.0
    # A reward call that takes longer fails its group (0: no limit).
    reward_timeout_s: float = 60.0
    # The run stops with the first failure's traceback when this many groups fail in a
    # row (reward raised, timed out, or returned something that is not a real number).
    max_consecutive_group_failures: int = 32
    extra: dict[str, Any] = field(default_factory=dict)
    # The generation engine: "embedded" (plain torch, CPU or GPU) or "sglang" (the extra
    # ppo-driver[sglang], CUDA); engine_kwargs: extra sglang.Engine server arguments.
    engine: str = "embedded"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


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

    def model(self, role: Role) -> ModelConfig:
        """The section of ``role``: ``policy`` (also for ``actor``) or ``critic``."""
        return self.critic if role == "critic" else self.policy

    def model_parallel_sizes(self, role: Role) -> tuple[int, int]:
        """``(tensor, pipeline)`` parallel sizes of ``role``'s model: its
        ``megatron_cfg`` sizes with the Megatron backend, ``(1, 1)`` with plain torch."""
        mc = self.model(role).megatron_cfg
        if not mc.enabled:
            return 1, 1
        return mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size

    def dp_size(self, role: Role) -> int:
        """Data-parallel size of ``role``'s model: ``cluster.actor_gpus / (tp * pp)``.

        Both models run one rank per training GPU (the critic reuses the actor's
        placement bundles); ranks of one tensor x pipeline group see the same rows, so
        rows (and chunks) split over this many ranks only. ``tp = pp = 1`` with plain
        torch, where this is ``cluster.actor_gpus``.

        Raises:
            ValueError: naming the key, when ``tp * pp`` does not divide
                ``cluster.actor_gpus`` or a size is below 1 (``validate`` reports it).
        """
        tp, pp = self.model_parallel_sizes(role)
        gpus = self.cluster.actor_gpus
        if gpus < 1:
            raise ValueError(f"cluster.actor_gpus={gpus} is invalid: use at least 1")
        prefix = f"{'critic' if role == 'critic' else 'policy'}.megatron_cfg"
        return data_parallel_size(
            world_size=gpus, tp=tp, pp=pp, prefix=prefix, world_key="cluster.actor_gpus"
        )

    @property
    def group_alignment(self) -> int:
        """Batch and minimum must be multiples of this: ``ppo_sampler.group_alignment``
        over both models' data-parallel sizes (:meth:`dp_size`) and micro-batch sizes,
        so every chunk splits evenly over each model's data-parallel ranks.
        ``ValueError`` if impossible (a bad mesh, a non-positive size)."""
        return int(
            group_alignment(
                generations_per_prompt=self.ppo.num_generations_per_prompt,
                actor_dp=self.dp_size("policy"),
                critic_dp=self.dp_size("critic"),
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
    # A copy of the config validate() judged (None: a report built by hand).
    judged: DriverConfig | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_if_errors(self) -> None:
        if self.errors:
            raise ConfigError(self.errors)

    def valid(self) -> ValidConfig:
        """The config this report accepted, as a :class:`ValidConfig` (what ``train``
        takes); :class:`ConfigError` with every error when it has any."""
        self.raise_if_errors()
        if self.judged is None:
            raise ValueError("this report was not made by validate(): call validate(cfg)")
        return ValidConfig(copy.deepcopy(self.judged), tuple(self.warnings))


@dataclass(frozen=True)
class ValidConfig:
    """A :class:`DriverConfig` that :func:`validate` accepted, and its warnings: what
    ``ppo_driver.train`` runs. Made by :func:`validated` or ``ValidationReport.valid``
    (from a copy taken when it was judged, so a later edit of the original cannot bypass
    the checks); read its sections through ``.config``."""

    config: DriverConfig
    warnings: tuple[ConfigProblem, ...] = ()


def validated(cfg: DriverConfig | ValidConfig) -> ValidConfig:
    """``cfg`` validated: a :class:`ValidConfig` as it is, a :class:`DriverConfig` through
    :func:`validate` (:class:`ConfigError` listing every error). The Python API's door:
    ``train(DriverConfig(...))`` gets the same refusals as ``ppo-driver train``."""
    if isinstance(cfg, ValidConfig):
        return cfg
    return validate(cfg).valid()


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
        if not sep and item.lower().endswith((".yaml", ".yml")):
            problems.append(
                ConfigProblem(
                    key="--config",
                    value=item,
                    message="a config file given as an override (overrides look like "
                    "section.key=value)",
                    fix=f"pass it as --config {item}",
                )
            )
            continue
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


# --------------------------------------------------------------------------- the packages' configs

ROLES: tuple[Role, Role] = ("policy", "critic")
MEGATRON_EXTRA = "ppo-trainer[megatron]"

# Fields of ppo_trainer's configs and the driver keys they come from.
_TRAIN_FIELDS = {
    "lr": "lr",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "warmup_steps": "warmup_steps",
    "micro_batch_size": "train_micro_batch_size",
    "offload_backend": "offload_backend",
}
_ACTOR_PPO_FIELDS = (
    "eps_clip",
    "eps_clip_high",
    "dual_clip",
    "kl_loss_coef",
    "kl_estimator",
    "entropy_coef",
)
_CRITIC_PPO_FIELDS = ("value_clip",)
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
_MODEL_FIELDS = (*_SIZE_FIELDS, "dtype")  # dtype applies to a model_path's weights too


def _section(role: Role) -> str:
    return "critic" if role == "critic" else "policy"


def model_path(cfg: DriverConfig, role: Role) -> str | None:
    """The Hugging Face model directory ``role``'s model is built from, made absolute
    (Ray workers on any node read it): its section's ``model_path``; a null
    ``critic.model_path`` takes the policy's (the critic is then the policy's checkpoint
    with a value head on top). None: the tiny Qwen2 of the section's sizes."""
    path = cfg.model(role).model_path
    if path is None and role == "critic":
        path = cfg.policy.model_path
    return None if path is None else str(Path(path).expanduser().absolute())


def _seed(cfg: DriverConfig, role: Role) -> int:
    """The model seed of ``role`` (the critic's differs from the policy's)."""
    return cfg.run.seed + (1 if role == "critic" else 0)


def _model_spec_kwargs(m: ModelConfig, *, vocab_size: int, seed: int) -> dict[str, Any]:
    """``ppo_trainer.ModelSpec`` keyword arguments of one model section."""
    return {
        "path": m.model_path,
        "vocab_size": vocab_size,
        **{name: getattr(m, name) for name in _MODEL_FIELDS},
        "seed": seed,
    }


def _backend_options(mc: MegatronCfg) -> dict[str, Any]:
    """The trainer's ``backend_options``: the ``megatron_cfg`` mapping that
    ``ppo_trainer.megatron.parse_options`` reads (nested ``optimizer``), ``{}`` with torch."""
    if not mc.enabled:
        return {}
    return {
        "tensor_model_parallel_size": mc.tensor_model_parallel_size,
        "pipeline_model_parallel_size": mc.pipeline_model_parallel_size,
        "use_megatron_fsdp": mc.use_megatron_fsdp,
        "fp8_param": mc.fp8_param,
        "fp8_recipe": mc.fp8_recipe,
        "transformer_impl": mc.transformer_impl,
        "optimizer": dataclasses.asdict(mc.optimizer),
    }


def _train_kwargs(cfg: DriverConfig, role: Role, *, samples_per_rank: int) -> dict[str, Any]:
    """The fields ``ActorConfig`` and ``CriticConfig`` share, for ``role`` (no model)."""
    m = cfg.model(role)
    micro = m.train_micro_batch_size
    return {
        "backend": "megatron" if m.megatron_cfg.enabled else "torch",
        "backend_options": _backend_options(m.megatron_cfg),
        "device": "auto",
        "lr": m.lr,
        "weight_decay": m.weight_decay,
        "max_grad_norm": m.max_grad_norm,
        "warmup_steps": m.warmup_steps,
        # null: the whole step of one data-parallel rank in one micro-batch. An explicit
        # value goes through as it is (0 must reach the trainer's check, not become null).
        "micro_batch_size": samples_per_rank if micro is None else micro,
        "loss_agg": cfg.ppo.loss_agg,
        "offload_backend": m.offload_backend,
    }


def _actor_kwargs(cfg: DriverConfig, *, samples_per_rank: int) -> dict[str, Any]:
    ppo = cfg.ppo
    return {
        **_train_kwargs(cfg, "policy", samples_per_rank=samples_per_rank),
        **{name: getattr(ppo, name) for name in _ACTOR_PPO_FIELDS},
    }


def _critic_kwargs(cfg: DriverConfig, *, samples_per_rank: int) -> dict[str, Any]:
    return {
        **_train_kwargs(cfg, "critic", samples_per_rank=samples_per_rank),
        **{name: getattr(cfg.ppo, name) for name in _CRITIC_PPO_FIELDS},
    }


def trainer_configs(cfg: DriverConfig, *, vocab_size: int) -> tuple[ActorConfig, CriticConfig]:
    """The ``ppo_trainer.ActorConfig`` and ``CriticConfig`` of this run.

    ``vocab_size`` is the tokenizer's (the tiny model's vocabulary; a ``model_path``
    checkpoint brings its own). The Megatron backend gets ``backend_options`` =
    the ``megatron_cfg`` section (:func:`ppo_trainer.megatron.parse_options` reads it);
    a null ``train_micro_batch_size`` becomes one data-parallel rank's share of the step
    (``samples_per_step / dp_size``). :func:`validate` builds these same objects and
    reports their errors by YAML key; here they raise ``ValueError``.
    """
    models = {
        role: ModelSpec(
            **{
                **_model_spec_kwargs(cfg.model(role), vocab_size=vocab_size, seed=_seed(cfg, role)),
                "path": model_path(cfg, role),
            }
        )
        for role in ROLES
    }
    actor = ActorConfig(
        model=models["policy"],
        **_actor_kwargs(cfg, samples_per_rank=_samples_per_rank(cfg, "policy")),
    )
    critic = CriticConfig(
        model=models["critic"],
        **_critic_kwargs(cfg, samples_per_rank=_samples_per_rank(cfg, "critic")),
    )
    return actor, critic


def _samples_per_rank(cfg: DriverConfig, role: Role) -> int:
    """Samples of one step on one data-parallel rank of ``role``."""
    return max(1, cfg.samples_per_step // cfg.dp_size(role))


def _sampler_kwargs(cfg: DriverConfig) -> dict[str, Any]:
    s = cfg.async_rl.sampler
    return {
        "num_prompts_per_step": cfg.batch_groups,
        "min_groups_for_streaming_train": cfg.min_groups,
        "name": s.name,
        "max_lookahead_versions": s.max_lookahead_versions,
        "max_staleness_versions": s.max_staleness_versions,
        "evict_stale": s.evict_stale,
        "deterministic_chunks": cfg.async_rl.deterministic_chunks,
    }


def sampler_config(cfg: DriverConfig) -> SamplerConfig:
    """The ``ppo_sampler.SamplerConfig`` of this run (``ValueError`` naming the key)."""
    return SamplerConfig(**_sampler_kwargs(cfg))


def _layout_kwargs(cfg: DriverConfig) -> dict[str, Any]:
    c = cfg.cluster
    return {"actor_gpus": c.actor_gpus, "rollout_gpus": c.rollout_gpus, "colocate": c.colocate}


def cluster_layout(cfg: DriverConfig) -> Layout:
    """The ``ppo_placement.Layout`` ``train`` reserves (critic on the actor's bundles),
    checked by ``check_streaming_layout`` when streaming. ``ValueError`` if refused."""
    layout = placement_layout(**_layout_kwargs(cfg))
    check_streaming_layout(layout, streaming=cfg.streaming)
    return layout


# --------------------------------------------------------------------------- validate


def validate(cfg: DriverConfig) -> ValidationReport:
    """Every value the trainer, the sampler, the placement or the engines would refuse.

    Asks each package's own rules, as data, with the values ``train`` builds its configs
    from (``ppo_sampler.SamplerConfig.problems``, ``ppo_trainer.ModelSpec`` /
    ``ActorConfig`` / ``CriticConfig.problems``, ``ppo_trainer.option_problems`` and
    ``mesh_problems`` for the Megatron backend, ``ppo_placement.layout_problems``) and
    reports each refused field under the YAML key the tables (:data:`SAMPLER_KEYS`,
    :func:`trainer_keys`, :data:`LAYOUT_KEYS`) map it to. The driver adds the keys no
    package reads and the rules across packages: the streaming rules of the document, one
    layout for both models, group alignment over each model's data-parallel size, the
    optional extras, the model / data files and the reward function (imported here).
    Runs before Ray starts and returns all problems at once; never raises.
    """
    r = ValidationReport(judged=copy.deepcopy(cfg))
    r.errors.extend(_non_finite_problem(key, value) for key, value in _non_finite(cfg))
    _check_driver_ranges(r, cfg)
    _check_sampler(r, cfg)
    _check_rules(r, cfg)
    _check_trainer(r, cfg)
    _check_offload_backend(r, cfg)
    _check_dtype(r, cfg)
    mesh_ok = _check_megatron(r, cfg)
    _check_layout(r, cfg)
    _check_colocated_lookahead(r, cfg)
    if mesh_ok:
        _check_alignment(r, cfg)
    _check_files(r, cfg)
    _check_reward(r, cfg)
    _check_cluster_address(r, cfg)
    _check_engine(r, cfg)
    _check_tensorboard(r, cfg)
    return r


# --------------------------------------------------------------------------- the driver's own keys


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


def _streaming_why(cfg: DriverConfig) -> str:
    return (
        f"streaming is on (async_rl.min_groups_for_streaming_train={cfg.min_groups} < "
        f"ppo.num_prompts_per_step={cfg.batch_groups})"
    )


def _streams(cfg: DriverConfig) -> bool:
    """Streaming, judged only when the batch and minimum are usable."""
    return 1 <= cfg.min_groups < cfg.batch_groups


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


# --------------------------------------------------------------------------- the packages' checks


class _PackageProblem(typing.Protocol):
    """What every package's problem record carries (``SamplerProblem``,
    ``LayoutProblem``, ``TrainerProblem``, ``MegatronProblem``): the package's own field
    name, the value, what is wrong and the fix."""

    @property
    def field(self) -> str: ...
    @property
    def value(self) -> object: ...
    @property
    def message(self) -> str: ...
    @property
    def fix(self) -> str: ...


# YAML key of each package field (the packages name fields their own way). A field
# missing from its table is one YAML cannot set; it is reported under ``<section>.<field>``.
SAMPLER_KEYS = {
    "num_prompts_per_step": "ppo.num_prompts_per_step",
    "min_groups_for_streaming_train": "async_rl.min_groups_for_streaming_train",
    "name": "async_rl.sampler.name",
    "max_lookahead_versions": "async_rl.sampler.max_lookahead_versions",
    "max_staleness_versions": "async_rl.sampler.max_staleness_versions",
    "evict_stale": "async_rl.sampler.evict_stale",
    "deterministic_chunks": "async_rl.deterministic_chunks",
}
LAYOUT_KEYS = {name: f"cluster.{name}" for name in ("actor_gpus", "rollout_gpus", "colocate")}
# Fixes in YAML terms where the package's own names parameters YAML does not have.
_GPUS_FIX = "set cluster.{0} to at least 1 ({1})"
LAYOUT_FIXES = {
    "cluster.actor_gpus": _GPUS_FIX.format("actor_gpus", "actor and critic share them"),
    "cluster.rollout_gpus": _GPUS_FIX.format(
        "rollout_gpus",
        "the generation engines' GPUs; with cluster.colocate=true, full-batch mode "
        "only, they time-share the training GPUs",
    ),
}


def trainer_keys(role: Role) -> dict[str, str]:
    """YAML key of each ``ModelSpec`` / ``ActorConfig`` / ``CriticConfig`` field of ``role``."""
    section = _section(role)
    keys = {name: f"{section}.{name}" for name in _MODEL_FIELDS}
    keys |= {field: f"{section}.{name}" for field, name in _TRAIN_FIELDS.items()}
    ppo = _ACTOR_PPO_FIELDS if role != "critic" else _CRITIC_PPO_FIELDS
    keys |= {name: f"ppo.{name}" for name in ("loss_agg", *ppo)}
    return keys


def _report(
    r: ValidationReport,
    who: str,
    problems: Iterable[_PackageProblem],
    keys: Mapping[str, str],
    section: str,
    fixes: Mapping[str, str] | None = None,
) -> None:
    """Each package problem under the YAML key ``keys`` maps its field to (``who``: the
    error's wording, ``{}`` the package's message); a key reported already (non-finite,
    or a ``ppo`` key refused by both models) is not repeated."""
    for p in problems:
        key = keys.get(p.field, f"{section}.{p.field}")
        warning = getattr(p, "severity", "error") == "warning"
        into = r.warnings if warning else r.errors
        if any(q.key == key for q in into):
            continue
        fix = (fixes or {}).get(key, p.fix)
        into.append(
            ConfigProblem(key, p.value, who.format(p.message), fix)
            if not warning
            else ConfigProblem(key, p.value, p.message, fix, severity="warning")
        )


def _check_sampler(r: ValidationReport, cfg: DriverConfig) -> None:
    """``ppo_sampler.SamplerConfig``: the batch, the readiness minimum, the sampler."""
    problems = SamplerConfig.problems(**_sampler_kwargs(cfg))
    _report(
        r, "ppo_sampler.SamplerConfig refuses it ({})", problems, SAMPLER_KEYS, "async_rl.sampler"
    )


def _check_trainer(r: ValidationReport, cfg: DriverConfig) -> None:
    """``ppo_trainer``'s ``ModelSpec``, ``ActorConfig`` and ``CriticConfig``: the very
    fields ``train`` builds them from (:func:`trainer_configs`), problems by YAML key."""
    vocab = _builtin_vocab_size()
    for role in ROLES:
        keys, section = trainer_keys(role), _section(role)
        spec = _model_spec_kwargs(cfg.model(role), vocab_size=vocab, seed=_seed(cfg, role))
        spec["path"] = model_path(cfg, role)
        _report(
            r, "ppo_trainer.ModelSpec refuses it ({})", ModelSpec.problems(**spec), keys, section
        )
        per_rank = _samples_per_rank_or_guess(cfg, role)
        if role == "critic":
            problems = CriticConfig.problems(**_critic_kwargs(cfg, samples_per_rank=per_rank))
        else:
            problems = ActorConfig.problems(**_actor_kwargs(cfg, samples_per_rank=per_rank))
        who = (
            f"ppo_trainer.{'CriticConfig' if role == 'critic' else 'ActorConfig'} refuses it ({{}})"
        )
        _report(r, who, problems, keys, section)


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


def _check_offload_backend(r: ValidationReport, cfg: DriverConfig) -> None:
    """``policy/critic.offload_backend`` on this machine's device, as the trainer's
    backends resolve it (``ppo_trainer.resolve_offload_backend``): ``memory_saver`` needs
    CUDA, torch_memory_saver and the torch backend (Megatron: ``host_copy`` only);
    ``none`` (offload off, the shared actor/critic report's debugging switch) is warned
    about."""
    device = "cuda" if _cuda_available() else "cpu"
    for role in ROLES:
        section = _section(role)
        m = cfg.model(role)
        key = f"{section}.offload_backend"
        if m.offload_backend not in OFFLOAD_BACKENDS or any(p.key == key for p in r.errors):
            continue  # the trainer's config check reports an unknown name
        if m.offload_backend == "none":
            r.warnings.append(
                ConfigProblem(
                    key,
                    "none",
                    f"offload is off: the {role} stays on the training devices while the other "
                    "model works, so both models and their optimizer states must fit there "
                    "at once (for debugging offload only)",
                    f"set {key}=auto to time-share the devices",
                    severity="warning",
                )
            )
        if m.offload_backend not in ("memory_saver", "torch_memory_saver"):
            continue  # auto, host_copy and none run everywhere
        backend = "megatron" if m.megatron_cfg.enabled else "torch"
        problem = memory_saver_problem(device=device, backend=backend, key=key)
        if problem is not None:
            r.errors.append(ConfigProblem(key, m.offload_backend, *problem))


def _samples_per_rank_or_guess(cfg: DriverConfig, role: Role) -> int:
    """:func:`_samples_per_rank`; a guess when the mesh is broken (``_check_mesh``
    reports that), so that the trainer's other checks still run."""
    try:
        return _samples_per_rank(cfg, role)
    except ValueError:
        return max(1, cfg.samples_per_step // max(1, cfg.cluster.actor_gpus))


def _builtin_vocab_size() -> int:
    """The vocabulary ``train`` gives the tiny model (the built-in task's tokenizer)."""
    from ppo_driver.rollout import TASK_ALPHABET, CharTokenizer  # lazy: loads the engines

    return CharTokenizer(TASK_ALPHABET).vocab_size


# --------------------------------------------------------------------------- placement


def _check_layout(r: ValidationReport, cfg: DriverConfig) -> None:
    """The bundle layout ``train`` reserves, as ppo_placement judges it; streaming needs
    generation on its own devices (``streaming_layout_problems``)."""
    kwargs = _layout_kwargs(cfg)
    problems = layout_problems(**kwargs)
    _report(
        r,
        "ppo_placement.placement_layout refuses it ({})",
        problems,
        LAYOUT_KEYS,
        "cluster",
        LAYOUT_FIXES,
    )
    if problems:
        return
    for p in streaming_layout_problems(placement_layout(**kwargs), streaming=_streams(cfg)):
        r.errors.append(
            ConfigProblem(
                LAYOUT_KEYS[p.field],
                cfg.cluster.colocate,
                f"{_streaming_why(cfg)}; streaming needs generation on its own devices "
                f"(ppo_placement.check_streaming_layout refuses a colocated layout: {p.message})",
                "set cluster.colocate=false and cluster.rollout_gpus >= 1, "
                f"or async_rl.min_groups_for_streaming_train={cfg.batch_groups} for full-batch mode",
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


# --------------------------------------------------------------------------- Megatron


def _check_megatron(r: ValidationReport, cfg: DriverConfig) -> bool:
    """The Megatron backend: its option parser (with the extra), the rules it leaves to
    set-up (Transformer Engine, FP8 recipes), the mesh, and one backend and layout for
    both models. Returns whether both models' meshes are usable (``dp_size``)."""
    enabled = [role for role in ROLES if cfg.model(role).megatron_cfg.enabled]
    for role in ROLES:
        if role not in enabled:
            _warn_inert_megatron(r, cfg, role)
    if not enabled:
        return True
    why = _megatron_import_error()
    if why is not None:
        p = f"{enabled[0]}.megatron_cfg"
        r.errors.append(
            ConfigProblem(
                f"{p}.enabled",
                True,
                f"the Megatron backend cannot be imported ({why})",
                f"install the extra {MEGATRON_EXTRA} (in this workspace: "
                f"`uv sync --extra megatron`), or set {p}.enabled=false",
            )
        )
    mesh_ok = True
    for role in enabled:
        if why is None:
            _check_megatron_model(r, cfg, role)
        _check_megatron_options(r, cfg, role, te=None if why is not None else _te_available())
        mesh_ok &= _check_mesh(r, cfg, role)
    _check_megatron_pair(r, cfg)
    return mesh_ok


def _check_megatron_model(r: ValidationReport, cfg: DriverConfig, role: Role) -> None:
    """The checkpoint ``role`` is built from is one the megatron backend builds
    (``ppo_trainer.megatron.model_config_problems``: the Llama / Qwen2 family with plain
    RoPE); the built-in tiny model always is."""
    from ppo_trainer.megatron import MODEL_FAMILY, model_config_problems  # lazy: the extra

    source = model_path(cfg, role)
    if source is None:
        return
    key = f"{role}.model_path" if cfg.model(role).model_path is not None else "policy.model_path"
    try:
        hf_config = _hf_config(source)
    except Exception:  # reported by _check_model_dirs
        return
    problems = model_config_problems(hf_config)
    if problems:
        r.errors.append(
            ConfigProblem(
                key,
                source,
                f"the {role}'s model cannot be built by the megatron backend: "
                f"{'; '.join(problems)}",
                f"use a {'/'.join(MODEL_FAMILY)} model with plain RoPE, or set "
                f"{role}.megatron_cfg.enabled=false (the torch backend builds any causal LM)",
            )
        )


def _megatron_import_error() -> str | None:
    """Why the trainer's Megatron backend cannot be imported here (None: it can)."""
    try:
        get_backend("megatron")
    except ImportError as exc:
        return str(exc).splitlines()[0]
    return None


def _warn_inert_megatron(r: ValidationReport, cfg: DriverConfig, role: Role) -> None:
    """``megatron_cfg`` settings of a model that trains with plain torch do nothing."""
    p = f"{role}.megatron_cfg"
    mine = _leaves(dataclasses.asdict(cfg.model(role).megatron_cfg))
    for name, default in _leaves(dataclasses.asdict(MegatronCfg())).items():
        if name != "enabled" and mine[name] != default:
            r.warnings.append(
                ConfigProblem(
                    f"{p}.{name}",
                    mine[name],
                    f"has no effect while {p}.enabled is false (the model trains with plain torch)",
                    f"set {p}.enabled=true to use it, or remove {p}.{name}",
                    severity="warning",
                )
            )


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_megatron_pair(r: ValidationReport, cfg: DriverConfig) -> None:
    """Actor and critic: one backend, one parallel layout (critic rank r runs on actor
    rank r's bundle and hands it its values)."""
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
        return
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        mine, theirs = getattr(critic, name), getattr(policy, name)
        key = f"critic.megatron_cfg.{name}"
        if mine != theirs and min(mine, theirs) >= 1 and all(p.key != key for p in r.errors):
            r.errors.append(
                ConfigProblem(
                    key,
                    mine,
                    f"actor and critic must use the same parallel layout (policy has "
                    f"{theirs}): the critic reuses the actor's placement bundles, critic "
                    "rank r runs beside actor rank r and hands it its values",
                    f"set critic.megatron_cfg.{name}={theirs}",
                )
            )


def _te_available() -> bool:
    from ppo_trainer.megatron import transformer_engine_available  # lazy: the extra

    return transformer_engine_available()


def _check_megatron_options(
    r: ValidationReport, cfg: DriverConfig, role: Role, *, te: bool | None
) -> None:
    """``ppo_trainer.option_problems`` (the rules ``parse_options`` and the backend's
    set-up apply) on the ``backend_options`` ``train`` passes; ``te``: whether Transformer
    Engine is usable here (None: the extra is missing, reported already)."""
    p = f"{role}.megatron_cfg"
    options = _backend_options(cfg.model(role).megatron_cfg)
    problems = option_problems(options, prefix=p, te_available=te)
    _report(
        r,
        "not supported by the Megatron backend: {} (ppo_trainer.option_problems)",
        problems,
        {},
        p,
    )


@dataclass(frozen=True)
class _Shape:
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    source: str


def _model_shape(cfg: DriverConfig, role: Role) -> _Shape | None:
    """The head / layer / vocabulary counts the trainer builds ``role`` with: the
    checkpoint's config.json with a model_path, else the tiny model of the config."""
    m = cfg.model(role)
    source = model_path(cfg, role)  # the critic's defaults to the policy's
    if source is None:
        if min(m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers) < 1:
            return None  # reported by ppo_trainer.ModelSpec
        return _Shape(
            m.num_attention_heads,
            m.num_key_value_heads,
            m.num_hidden_layers,
            _builtin_vocab_size(),
            f"the {role}.* model sizes and the built-in task's vocabulary",
        )
    path = Path(source) / "config.json"
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


def _check_mesh(r: ValidationReport, cfg: DriverConfig, role: Role) -> bool:
    """The model's ranks as the shared placement holds them (one per training GPU,
    ``cluster.actor_gpus``): ``tp * pp`` must divide them (the rest is data parallel),
    ``tp`` the heads, key/value heads and vocabulary, ``pp`` the layers (what megatron's
    parallel_state and the trainer's transformer config refuse at set-up). Returns
    whether ``dp_size(role)`` is defined."""
    p = f"{role}.megatron_cfg"
    tp, pp = cfg.model_parallel_sizes(role)
    gpus = cfg.cluster.actor_gpus
    shape = _model_shape(cfg, role) if min(tp, pp) >= 1 else None
    problems = mesh_problems(
        world_size=gpus,
        tp=tp,
        pp=pp,
        heads=None if shape is None else shape.heads,
        kv_heads=None if shape is None else shape.kv_heads,
        vocab=None if shape is None else shape.vocab,
        layers=None if shape is None else shape.layers,
        source="" if shape is None else shape.source,
        prefix=p,
        world_key="cluster.actor_gpus",
    )
    _report(r, "the Megatron mesh: {} (ppo_trainer.mesh_problems)", problems, {}, p)
    return min(tp, pp, gpus) >= 1 and gpus % (tp * pp) == 0


# --------------------------------------------------------------------------- alignment


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


# --------------------------------------------------------------------------- files, reward


def _check_files(r: ValidationReport, cfg: DriverConfig) -> None:
    """Model directories (config.json, safetensors weights), the policy's tokenizer,
    and the prompt data sets, read and encoded line by line as ``train`` will."""
    shapes = _check_model_dirs(r, cfg)
    tokenizer = _check_tokenizer(r, cfg, shapes)
    _check_data(r, cfg, tokenizer)


def _hf_config(source: str) -> Any:
    """``transformers.AutoConfig`` of the model directory ``source``, as the workers load
    it (raises as that does). Several checks ask for it: it is read once per state of the
    directory's config.json."""
    stat = (Path(source) / "config.json").stat()
    return _hf_config_read(str(Path(source).absolute()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _hf_config_read(source: str, mtime_ns: int, size: int) -> Any:
    return transformers.AutoConfig.from_pretrained(source)


def _check_model_dirs(r: ValidationReport, cfg: DriverConfig) -> dict[Role, dict[str, Any]]:
    """Each ``model_path`` given: a directory with ``config.json`` (a JSON object) and
    ``*.safetensors`` weights. Returns the config.json of each role whose model comes
    from a directory (the critic's may be the policy's); sizes set beside a
    ``model_path`` are warned about (the checkpoint's config.json decides them)."""
    configs: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        path = getattr(cfg, role).model_path
        if path is None:
            continue
        key = f"{role}.model_path"
        fix = (
            f"point {key} at a local Hugging Face model directory (config.json, "
            "*.safetensors and, for the policy, the tokenizer files), or remove it for the "
            "built-in tiny model"
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
                continue
            if not any(model.glob("*.safetensors")):
                r.errors.append(
                    ConfigProblem(
                        key,
                        path,
                        f"{model} has no *.safetensors weights (the trainer loads "
                        "safetensors only, never pickled *.bin files)",
                        f"{fix}; convert the weights with save_pretrained(..., "
                        "safe_serialization=True)",
                    )
                )
                continue
            try:
                _hf_config(str(model))  # what the workers read
            except Exception as exc:  # transformers raises many kinds for a bad config
                r.errors.append(
                    ConfigProblem(
                        key,
                        path,
                        f"transformers cannot read {config}: {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())}",
                        f"{fix}; fix config.json (AutoConfig.from_pretrained must load it)",
                    )
                )
                continue
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


def _check_tokenizer(
    r: ValidationReport, cfg: DriverConfig, shapes: Mapping[Role, Mapping[str, Any]]
) -> Any:
    """The tokenizer ``train`` uses (``ppo_driver.workload.load_tokenizer_for``): the
    policy directory's own, loaded with ``transformers.AutoTokenizer`` (local files
    only); the built-in character tokenizer without a ``policy.model_path``. Its ids
    must fit both models' vocabularies; ``rollout.apply_chat_template`` needs a chat
    template. Returns it, or None when it cannot be loaded (reported)."""
    from ppo_driver.rollout import TASK_ALPHABET, CharTokenizer, HFTokenizer  # lazy: torch

    path = cfg.policy.model_path
    tokenizer: Any
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
    r: ValidationReport, cfg: DriverConfig, key: str, path: str, dataset: Any
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


def _check_data(r: ValidationReport, cfg: DriverConfig, tokenizer: Any) -> None:
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
    every, eval_path = cfg.run.eval_every, ro.eval_dataset_path
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
    jsonl = [
        k for k, v in (("dataset_path", ro.dataset_path), ("eval_dataset_path", eval_path)) if v
    ]
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


# --------------------------------------------------------------------------- cluster, engine, metrics

ENGINES = ("embedded", "sglang")
"""``rollout.engine`` values: the plain-torch engine (CPU or GPU) and sglang (CUDA)."""
SGLANG_EXTRA = "ppo-driver[sglang]"
TENSORBOARD_EXTRA = "ppo-driver[tensorboard]"
# sglang.Engine arguments the driver sets itself: the key that decides each, or why.
_SGLANG_RESERVED = {
    "model_path": "policy.model_path (the built-in tiny model is written for it)",
    "random_seed": "run.seed",
    "skip_tokenizer_init": "the driver hands sglang token ids and reads token ids back",
    "tp_size": "each engine holds one rollout GPU (more GPUs: more rollout.num_engines)",
}


def _module_available(name: str) -> bool:
    """Whether ``name`` can be imported here (not imported: no side effects)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check_cluster_address(r: ValidationReport, cfg: DriverConfig) -> None:
    """``cluster.address``: null (a local cluster), ``auto`` or ``host:port`` (join)."""
    address = cfg.cluster.address
    if address is None:
        _check_local_cluster(r, cfg)
        return
    if not cfg.cluster.logical_gpus:
        r.warnings.append(
            ConfigProblem(
                "cluster.logical_gpus",
                False,
                "has no effect when joining a cluster (cluster.address is set): its nodes' "
                "`ray start --num-gpus` decide the GPUs",
                "remove cluster.logical_gpus",
                severity="warning",
            )
        )
    problem = cluster_address_problem(address)
    if problem is not None:
        head, fix = problem
        r.errors.append(
            ConfigProblem(
                "cluster.address", address, head, f"{fix}, or null to start a local cluster"
            )
        )
    if cfg.cluster.num_cpus is not None:
        r.warnings.append(
            ConfigProblem(
                "cluster.num_cpus",
                cfg.cluster.num_cpus,
                "has no effect when joining a cluster (cluster.address is set): its nodes' "
                "`ray start --num-cpus/--num-gpus` decide the resources",
                "remove cluster.num_cpus",
                severity="warning",
            )
        )


def cuda_device_count() -> int:
    """CUDA devices this machine has (0 without CUDA)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def local_num_cpus(cfg: DriverConfig, layout: Layout) -> int:
    """The CPUs of the local Ray cluster ``train`` starts: ``cluster.num_cpus``, or by
    default enough for every bundle (one CPU each) and at least
    ``max(4, 2 * actor_gpus + num_engines)``."""
    if cfg.cluster.num_cpus is not None:
        return cfg.cluster.num_cpus
    return max(4, 2 * cfg.cluster.actor_gpus + cfg.rollout.num_engines, layout.num_gpus)


def _check_local_cluster(r: ValidationReport, cfg: DriverConfig) -> None:
    """The local cluster: each bundle the layout reserves takes one CPU of
    ``cluster.num_cpus`` and one GPU (``cluster.logical_gpus=false``: one of the machine's
    CUDA devices)."""
    try:
        needed = cluster_layout(cfg).num_gpus
    except ValueError:
        return  # the layout's own error is reported already
    num_cpus = cfg.cluster.num_cpus
    if num_cpus is not None and 0 < num_cpus < needed:
        r.errors.append(
            ConfigProblem(
                "cluster.num_cpus",
                num_cpus,
                f"the layout reserves {needed} bundle(s) of 1 GPU + 1 CPU "
                f"(cluster.actor_gpus={cfg.cluster.actor_gpus}, "
                f"cluster.rollout_gpus={cfg.cluster.rollout_gpus}), more than the local "
                "cluster's CPUs: the placement group could never be created",
                f"set cluster.num_cpus to at least {needed}, or null (enough for the layout)",
            )
        )
    if cfg.cluster.logical_gpus:
        return
    have = cuda_device_count()
    if have < needed:
        r.errors.append(
            ConfigProblem(
                "cluster.logical_gpus",
                False,
                f"this machine has {have} CUDA device(s), and the layout reserves {needed} "
                f"(cluster.actor_gpus={cfg.cluster.actor_gpus}, "
                f"cluster.rollout_gpus={cfg.cluster.rollout_gpus})",
                "set cluster.logical_gpus=true (logical GPUs: CPU runs and tests), ask for "
                "fewer GPUs, or run on a machine with enough",
            )
        )


def _check_engine(r: ValidationReport, cfg: DriverConfig) -> None:
    """``rollout.engine`` and what it needs: sglang wants its extra, CUDA and a GPU per
    engine; ``rollout.engine_kwargs`` are sglang's own server arguments."""
    ro = cfg.rollout
    if ro.engine not in ENGINES:
        close = difflib.get_close_matches(str(ro.engine), ENGINES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        r.errors.append(
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                f"unknown generation engine{hint}",
                f"set rollout.engine to one of {', '.join(ENGINES)}",
            )
        )
        return
    if ro.engine == "embedded":
        if ro.engine_kwargs:
            r.errors.append(
                ConfigProblem(
                    "rollout.engine_kwargs",
                    ro.engine_kwargs,
                    "only the sglang engine reads it (rollout.engine=embedded)",
                    "remove rollout.engine_kwargs, or set rollout.engine=sglang",
                )
            )
        return
    missing = []
    if not _module_available("sglang"):
        missing.append(
            f"the sglang package (the extra {SGLANG_EXTRA}: `uv sync --extra sglang` in this "
            "workspace, `pip install 'ppo-driver[sglang]'` elsewhere)"
        )
    if not _cuda_available():
        missing.append("CUDA (sglang generates on NVIDIA GPUs; this machine has none)")
    if missing and cfg.cluster.address is None:
        r.errors.append(
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                "the sglang engine cannot run on this machine: it needs " + " and ".join(missing),
                f"install {SGLANG_EXTRA} on a CUDA machine, or set rollout.engine=embedded "
                "(runs anywhere, CPU included)",
            )
        )
    elif missing:
        r.warnings.append(
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                "this machine lacks " + " and ".join(missing) + "; that is fine only if the "
                f"cluster at cluster.address={cfg.cluster.address} has them on its GPU nodes "
                "(the engines run there)",
                f"install {SGLANG_EXTRA} and CUDA on the cluster's GPU nodes",
                severity="warning",
            )
        )
    if ro.num_engines > cfg.cluster.rollout_gpus >= 1:
        r.errors.append(
            ConfigProblem(
                "rollout.num_engines",
                ro.num_engines,
                f"each sglang engine needs a rollout GPU of its own, and cluster.rollout_gpus="
                f"{cfg.cluster.rollout_gpus}",
                f"set rollout.num_engines to at most {cfg.cluster.rollout_gpus}, or raise "
                "cluster.rollout_gpus",
            )
        )
    if ro.decode_delay_s:
        r.warnings.append(
            ConfigProblem(
                "rollout.decode_delay_s",
                ro.decode_delay_s,
                "has no effect with rollout.engine=sglang (only the embedded engine emulates "
                "a slower device)",
                "remove rollout.decode_delay_s",
                severity="warning",
            )
        )
    _check_engine_kwargs(r, cfg)


def _check_engine_kwargs(r: ValidationReport, cfg: DriverConfig) -> None:
    """sglang server arguments: none the driver sets itself, and (where sglang imports)
    only names ``sglang.srt.server_args.ServerArgs`` knows."""
    kwargs = cfg.rollout.engine_kwargs
    for name, why in _SGLANG_RESERVED.items():
        if name in kwargs:
            r.errors.append(
                ConfigProblem(
                    f"rollout.engine_kwargs.{name}",
                    kwargs[name],
                    f"the driver sets it: {why}",
                    f"remove rollout.engine_kwargs.{name}",
                )
            )
    known = _sglang_server_args()
    if known is not None:
        for name in kwargs:
            if name not in known and name not in _SGLANG_RESERVED:
                close = difflib.get_close_matches(str(name), sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                r.errors.append(
                    ConfigProblem(
                        f"rollout.engine_kwargs.{name}",
                        kwargs[name],
                        f"not an sglang server argument (sglang.srt.server_args.ServerArgs){hint}",
                        f"remove rollout.engine_kwargs.{name}, or use an argument of "
                        "`python -m sglang.launch_server --help` (with _ for -)",
                    )
                )
    if (
        cfg.cluster.colocate
        and cfg.ppo.critic_warmup_steps > 0
        and kwargs.get("enable_weights_cpu_backup", True) is False
    ):
        r.errors.append(
            ConfigProblem(
                "rollout.engine_kwargs.enable_weights_cpu_backup",
                False,
                "with cluster.colocate=true sglang releases its memory while training runs "
                "and, without this backup, loses its weights; a critic warm-up step "
                f"(ppo.critic_warmup_steps={cfg.ppo.critic_warmup_steps}) refits nothing "
                "before generation resumes, so the engine would have no weights",
                "remove rollout.engine_kwargs.enable_weights_cpu_backup (it defaults to true "
                "when colocated), or set ppo.critic_warmup_steps=0",
            )
        )
    if (
        cfg.cluster.colocate
        and "mem_fraction_static" not in kwargs
        and not any(p.key == "rollout.engine" for p in r.errors)
    ):
        r.warnings.append(
            ConfigProblem(
                "rollout.engine_kwargs.mem_fraction_static",
                None,
                "with cluster.colocate=true sglang shares the training GPUs, but by default "
                "it reserves most of a GPU's memory for itself",
                "set rollout.engine_kwargs.mem_fraction_static (e.g. 0.3) to leave the "
                "trainers room",
                severity="warning",
            )
        )


def _sglang_server_args() -> frozenset[str] | None:
    """The fields of sglang's ``ServerArgs`` (None when sglang does not import here, or
    when its ``ServerArgs`` is of a kind this does not know: the keys are then not
    checked, and sglang itself refuses an unknown one at start-up).

    ``ServerArgs`` was a dataclass up to sglang 0.5.x and is a msgspec ``Struct`` in
    0.5.23 (``dataclasses.fields`` raises TypeError on it), so both are read; validate
    never raises, so nothing here may either."""
    if not _module_available("sglang"):
        return None
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # a broken or CUDA-less install: the engine reports it at start-up
        return None
    return _struct_field_names(ServerArgs)


def _struct_field_names(cls: Any) -> frozenset[str] | None:
    """The field names of a dataclass or a msgspec ``Struct`` class, else None."""
    try:
        if dataclasses.is_dataclass(cls):
            return frozenset(f.name for f in dataclasses.fields(cls))
        if _module_available("msgspec"):  # sglang depends on it
            import msgspec

            if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
                return frozenset(f.name for f in msgspec.structs.fields(cls))
    except Exception:  # an unexpected sglang or msgspec: the keys are not checked
        return None
    return None


def _check_tensorboard(r: ValidationReport, cfg: DriverConfig) -> None:
    """``run.tensorboard`` needs the tensorboard package (an optional extra)."""
    if cfg.run.tensorboard and not _module_available("tensorboard"):
        r.errors.append(
            ConfigProblem(
                "run.tensorboard",
                True,
                "writing TensorBoard event files needs the tensorboard package, which is not "
                "installed",
                f"install the extra {TENSORBOARD_EXTRA} (in this workspace: `uv sync --extra "
                "tensorboard`), or set run.tensorboard=false (metrics.jsonl is written either "
                "way)",
            )
        )
