"""``ppo-driver validate`` refuses, before Ray starts, every value that the trainer, the
sampler, the placement or the engines would refuse later, and reports all of them at once.

``AGREEMENT`` is the validate/trainer agreement table: every error a package raises for a
field YAML reaches, fed through ``validate``, which must name the YAML key. ``CASES`` are
the driver's own keys and rules (ranges of keys no package reads, non-finite floats,
files, the reward). Each problem names its YAML key and carries a fix.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from ppo_driver.cli import main
from ppo_driver.config import (
    ConfigError,
    ConfigProblem,
    DriverConfig,
    default_config_path,
    load_config,
    trainer_configs,
    validate,
)
from ppo_placement import check_streaming_layout, placement_layout
from ppo_sampler import SamplerConfig
from ppo_trainer import ActorConfig, CriticConfig, ModelSpec
from workload_testlib import make_model_dir

FULL = "async_rl.min_groups_for_streaming_train=16"  # batch 16 in the default: full-batch
MEGATRON = ["policy.megatron_cfg.enabled=true", "critic.megatron_cfg.enabled=true"]
ROLES = ("policy", "critic")
REWARDS = "driver_validate_rewards"  # a reward module written by the `reward_module` fixture


def _errors(overrides: list[str]) -> list[ConfigProblem]:
    _, report = load_config(None, overrides, check=False)
    return report.errors


def _megatron_available() -> bool:
    from ppo_trainer import backend_importable

    return backend_importable("megatron")


def _te_available() -> bool:
    if not _megatron_available():
        return False
    from ppo_trainer.megatron import transformer_engine_available

    return bool(transformer_engine_available())


needs_megatron = pytest.mark.skipif(
    not _megatron_available(), reason="needs the megatron extra (ppo-trainer[megatron])"
)


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real importable module with a good reward, a non-callable and a bad signature."""
    (tmp_path / f"{REWARDS}.py").write_text(
        "def good(*, response, record, finish_reason):\n"
        "    return 1.0\n"
        "def positional(text):\n"
        "    return 1.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, REWARDS, raising=False)
    return REWARDS


# --------------------------------------------------------------------------- the agreement
#
# The validate/trainer agreement (issue 12): every ValueError that a package raises for a
# field YAML can reach, enumerated from the packages' source (ppo_trainer's ModelSpec,
# ActorConfig, CriticConfig, the Megatron option parser and what the Megatron backend
# refuses at set-up; ppo_sampler.SamplerConfig; ppo_placement.placement_layout and
# check_streaming_layout). Each row feeds the value through `validate` and asserts it is
# caught there, naming the YAML key; `refuse` builds the package's own object with the
# same value and proves the package really refuses it (so a row cannot rot silently).
# No Ray, no model built: a row costs one `validate`.


@dataclasses.dataclass(frozen=True)
class Case:
    field: str  # the package's field, "Class.field" (the coverage test counts them)
    overrides: tuple[str, ...]
    key: str  # the YAML key validate must name
    words: str  # from the package's own message (or the driver's, for set-up rules)
    refuse: Callable[[], object] | None  # the package refusing it directly (None: set-up)
    megatron: bool = False  # the row needs the megatron extra (the option parser)
    no_te: bool = False  # the row holds where Transformer Engine + CUDA are missing


def _parse(options: dict[str, Any], role: str = "policy") -> object:
    from ppo_trainer.megatron import parse_options

    return parse_options(options, role=role)


def _streaming_colocated() -> None:
    check_streaming_layout(
        placement_layout(actor_gpus=1, rollout_gpus=1, colocate=True), streaming=True
    )


def _sampler(**settings: Any) -> SamplerConfig:
    return SamplerConfig(num_prompts_per_step=16, min_groups_for_streaming_train=4, **settings)


MXFP8 = ["policy.megatron_cfg.fp8_param=true", "policy.megatron_cfg.fp8_recipe=mxfp8"]

AGREEMENT = [
    # --- ppo_trainer.ModelSpec: the tiny model of policy.* / critic.* ------------------
    Case(
        "ModelSpec.hidden_size",
        ("policy.hidden_size=0",),
        "policy.hidden_size",
        "positive integer",
        lambda: ModelSpec(hidden_size=0),
    ),
    Case(
        "ModelSpec.hidden_size",
        ("critic.hidden_size=66",),
        "critic.hidden_size",
        "divisible",
        lambda: ModelSpec(hidden_size=66),
    ),
    Case(
        "ModelSpec.intermediate_size",
        ("critic.intermediate_size=0",),
        "critic.intermediate_size",
        "positive integer",
        lambda: ModelSpec(intermediate_size=0),
    ),
    Case(
        "ModelSpec.num_hidden_layers",
        ("policy.num_hidden_layers=0",),
        "policy.num_hidden_layers",
        "positive integer",
        lambda: ModelSpec(num_hidden_layers=0),
    ),
    Case(
        "ModelSpec.num_attention_heads",
        ("critic.num_attention_heads=-4",),
        "critic.num_attention_heads",
        "positive integer",
        lambda: ModelSpec(num_attention_heads=-4),
    ),
    Case(
        "ModelSpec.num_key_value_heads",
        ("policy.num_key_value_heads=0",),
        "policy.num_key_value_heads",
        "positive integer",
        lambda: ModelSpec(num_key_value_heads=0),
    ),
    Case(
        "ModelSpec.num_key_value_heads",
        ("critic.num_key_value_heads=3",),
        "critic.num_key_value_heads",
        "must divide",
        lambda: ModelSpec(num_key_value_heads=3),
    ),
    Case(
        "ModelSpec.dtype",
        ("critic.dtype=half",),
        "critic.dtype",
        "use one of",
        lambda: ModelSpec(dtype="half"),
    ),
    # --- ActorConfig / CriticConfig: the optimizer of each model ------------------------
    Case(
        "ActorConfig.lr",
        ("policy.lr=0",),
        "policy.lr",
        "positive finite",
        lambda: ActorConfig(lr=0),
    ),
    Case(
        "CriticConfig.lr",
        ("critic.lr=-1",),
        "critic.lr",
        "positive finite",
        lambda: CriticConfig(lr=-1),
    ),
    Case(
        "ActorConfig.weight_decay",
        ("policy.weight_decay=-1",),
        "policy.weight_decay",
        ">= 0",
        lambda: ActorConfig(weight_decay=-1),
    ),
    Case(
        "CriticConfig.weight_decay",
        ("critic.weight_decay=-0.5",),
        "critic.weight_decay",
        ">= 0",
        lambda: CriticConfig(weight_decay=-0.5),
    ),
    Case(
        "ActorConfig.max_grad_norm",
        ("policy.max_grad_norm=-1",),
        "policy.max_grad_norm",
        "positive norm",
        lambda: ActorConfig(max_grad_norm=-1),
    ),
    Case(
        "CriticConfig.max_grad_norm",
        ("critic.max_grad_norm=0",),
        "critic.max_grad_norm",
        "positive norm",
        lambda: CriticConfig(max_grad_norm=0),
    ),
    Case(
        "ActorConfig.warmup_steps",
        ("policy.warmup_steps=-1",),
        "policy.warmup_steps",
        ">= 0",
        lambda: ActorConfig(warmup_steps=-1),
    ),
    Case(
        "CriticConfig.warmup_steps",
        ("critic.warmup_steps=-5",),
        "critic.warmup_steps",
        ">= 0",
        lambda: CriticConfig(warmup_steps=-5),
    ),
    # 0 used to become "null" on its way to the trainer (`or`): now it reaches the check.
    Case(
        "ActorConfig.micro_batch_size",
        ("policy.train_micro_batch_size=0",),
        "policy.train_micro_batch_size",
        "positive integer",
        lambda: ActorConfig(micro_batch_size=0),
    ),
    Case(
        "CriticConfig.micro_batch_size",
        ("critic.train_micro_batch_size=-2",),
        "critic.train_micro_batch_size",
        "positive integer",
        lambda: CriticConfig(micro_batch_size=-2),
    ),
    Case(
        "ActorConfig.loss_agg",
        ("ppo.loss_agg=mean",),
        "ppo.loss_agg",
        "'token', 'sample'",
        lambda: ActorConfig(loss_agg="mean"),
    ),
    Case(
        "CriticConfig.loss_agg",
        ("ppo.loss_agg=seq",),
        "ppo.loss_agg",
        "'token', 'sample'",
        lambda: CriticConfig(loss_agg="seq"),
    ),
    # --- ActorConfig: the PPO loss ------------------------------------------------------
    Case(
        "ActorConfig.eps_clip",
        ("ppo.eps_clip=0",),
        "ppo.eps_clip",
        "(0, 1)",
        lambda: ActorConfig(eps_clip=0),
    ),
    Case(
        "ActorConfig.eps_clip",
        ("ppo.eps_clip=1.5",),
        "ppo.eps_clip",
        "(0, 1)",
        lambda: ActorConfig(eps_clip=1.5),
    ),
    Case(
        "ActorConfig.eps_clip_high",
        ("ppo.eps_clip_high=-1",),
        "ppo.eps_clip_high",
        "positive value or null",
        lambda: ActorConfig(eps_clip_high=-1),
    ),
    Case(
        "ActorConfig.eps_clip_high",
        ("ppo.eps_clip_high=0",),
        "ppo.eps_clip_high",
        "positive value or null",
        lambda: ActorConfig(eps_clip_high=0),
    ),
    Case(
        "ActorConfig.dual_clip",
        ("ppo.dual_clip=0.5",),
        "ppo.dual_clip",
        "> 1",
        lambda: ActorConfig(dual_clip=0.5),
    ),
    Case(
        "ActorConfig.dual_clip",
        ("ppo.dual_clip=1",),
        "ppo.dual_clip",
        "> 1",
        lambda: ActorConfig(dual_clip=1.0),
    ),
    Case(
        "ActorConfig.kl_loss_coef",
        ("ppo.kl_loss_coef=-0.1",),
        "ppo.kl_loss_coef",
        ">= 0",
        lambda: ActorConfig(kl_loss_coef=-0.1),
    ),
    Case(
        "ActorConfig.kl_estimator",
        ("ppo.kl_estimator=k9",),
        "ppo.kl_estimator",
        "'k3'",
        lambda: ActorConfig(kl_estimator="k9"),
    ),
    Case(
        "ActorConfig.entropy_coef",
        ("ppo.entropy_coef=-1",),
        "ppo.entropy_coef",
        ">= 0",
        lambda: ActorConfig(entropy_coef=-1),
    ),
    Case(
        "CriticConfig.value_clip",
        ("ppo.value_clip=-1",),
        "ppo.value_clip",
        "positive value or null",
        lambda: CriticConfig(value_clip=-1),
    ),
    Case(
        "CriticConfig.value_clip",
        ("ppo.value_clip=0",),
        "ppo.value_clip",
        "positive value or null",
        lambda: CriticConfig(value_clip=0),
    ),
    # --- ppo_sampler.SamplerConfig --------------------------------------------------------
    Case(
        "SamplerConfig.num_prompts_per_step",
        ("ppo.num_prompts_per_step=0",),
        "ppo.num_prompts_per_step",
        "int >= 1",
        lambda: SamplerConfig(num_prompts_per_step=0, min_groups_for_streaming_train=1),
    ),
    Case(
        "SamplerConfig.min_groups_for_streaming_train",
        ("async_rl.min_groups_for_streaming_train=0",),
        "async_rl.min_groups_for_streaming_train",
        "int >= 1",
        lambda: SamplerConfig(num_prompts_per_step=16, min_groups_for_streaming_train=0),
    ),
    Case(
        "SamplerConfig.min_groups_for_streaming_train",
        ("ppo.num_prompts_per_step=16", "async_rl.min_groups_for_streaming_train=17"),
        "async_rl.min_groups_for_streaming_train",
        "exceeds ppo.num_prompts_per_step=16",
        lambda: SamplerConfig(num_prompts_per_step=16, min_groups_for_streaming_train=17),
    ),
    Case(
        "SamplerConfig.name",
        ("async_rl.sampler.name=fifo",),
        "async_rl.sampler.name",
        "'in_order', 'ready_first'",
        lambda: _sampler(name="fifo"),
    ),
    Case(
        "SamplerConfig.max_lookahead_versions",
        ("async_rl.sampler.max_lookahead_versions=-1",),
        "async_rl.sampler.max_lookahead_versions",
        "int >= 0",
        lambda: _sampler(max_lookahead_versions=-1),
    ),
    Case(
        "SamplerConfig.max_staleness_versions",
        ("async_rl.sampler.max_staleness_versions=-2",),
        "async_rl.sampler.max_staleness_versions",
        "int >= 0",
        lambda: _sampler(max_staleness_versions=-2),
    ),
    # A non-bool never gets past the YAML coercion (it names the key the same way).
    Case(
        "SamplerConfig.evict_stale",
        ("async_rl.sampler.evict_stale=3",),
        "async_rl.sampler.evict_stale",
        "expected bool",
        lambda: _sampler(evict_stale=3),
    ),
    # async_rl.deterministic_chunks: only where no group's weights or chunk depend on timing
    Case(
        "SamplerConfig.deterministic_chunks",
        ("async_rl.deterministic_chunks=true", "async_rl.sampler.max_lookahead_versions=1"),
        "async_rl.deterministic_chunks",
        "needs async_rl.sampler.max_lookahead_versions=0, not 1",
        lambda: _sampler(deterministic_chunks=True, max_lookahead_versions=1),
    ),
    Case(
        "SamplerConfig.deterministic_chunks",
        ("async_rl.deterministic_chunks=true", "async_rl.sampler.name=ready_first"),
        "async_rl.deterministic_chunks",
        "needs async_rl.sampler.name=in_order, not 'ready_first'",
        lambda: _sampler(deterministic_chunks=True, name="ready_first"),
    ),
    # --- ppo_placement ----------------------------------------------------------------------
    Case(
        "placement_layout.actor_gpus",
        ("cluster.actor_gpus=0",),
        "cluster.actor_gpus",
        "training is on",
        lambda: placement_layout(actor_gpus=0, rollout_gpus=1),
    ),
    Case(
        "placement_layout.actor_gpus",
        ("cluster.actor_gpus=-1",),
        "cluster.actor_gpus",
        ">= 0",
        lambda: placement_layout(actor_gpus=-1, rollout_gpus=1),
    ),
    Case(
        "placement_layout.rollout_gpus",
        ("cluster.rollout_gpus=-1",),
        "cluster.rollout_gpus",
        ">= 0",
        lambda: placement_layout(actor_gpus=1, rollout_gpus=-1),
    ),
    Case(
        "placement_layout.rollout_gpus",
        (FULL, "cluster.rollout_gpus=0"),
        "cluster.rollout_gpus",
        "generation runs locally",
        lambda: placement_layout(actor_gpus=1, rollout_gpus=0),
    ),
    Case(
        "placement_layout.colocate",
        ("cluster.colocate=true",),
        "cluster.colocate",
        "own devices",
        _streaming_colocated,
    ),
    # --- the Megatron option parser (ppo_trainer.megatron.parse_options) -----------------
    Case(
        "parse_options.use_megatron_fsdp",
        (*MEGATRON, "policy.megatron_cfg.use_megatron_fsdp=true"),
        "policy.megatron_cfg.use_megatron_fsdp",
        "classic Megatron DDP",
        lambda: _parse({"use_megatron_fsdp": True}),
        megatron=True,
    ),
    Case(
        "parse_options.use_megatron_fsdp",
        (*MEGATRON, FULL, "critic.megatron_cfg.use_megatron_fsdp=true"),
        "critic.megatron_cfg.use_megatron_fsdp",
        "classic Megatron DDP",
        lambda: _parse({"use_megatron_fsdp": True}, "critic"),
        megatron=True,
    ),
    Case(
        "MegatronOptions.overlap_param_gather",
        (
            *MEGATRON,
            "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
            "policy.megatron_cfg.optimizer.overlap_param_gather=true",
        ),
        "policy.megatron_cfg.optimizer.overlap_param_gather",
        "not supported",
        lambda: _parse(
            {"optimizer": {"use_distributed_optimizer": True, "overlap_param_gather": True}}
        ),
        megatron=True,
    ),
    Case(
        "MegatronOptions.use_distributed_optimizer",
        (*MEGATRON, *MXFP8, "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"),
        "policy.megatron_cfg.optimizer.use_distributed_optimizer",
        "MXFP8",
        lambda: _parse(
            {
                "fp8_param": True,
                "fp8_recipe": "mxfp8",
                "optimizer": {"use_distributed_optimizer": True},
            }
        ),
        megatron=True,
    ),
    Case(
        "MegatronOptions.tensor_model_parallel_size",
        (
            *MEGATRON,
            "policy.megatron_cfg.tensor_model_parallel_size=0",
            "critic.megatron_cfg.tensor_model_parallel_size=0",
        ),
        "policy.megatron_cfg.tensor_model_parallel_size",
        "positive integer",
        lambda: _parse({"tensor_model_parallel_size": 0}),
        megatron=True,
    ),
    Case(
        "MegatronOptions.pipeline_model_parallel_size",
        (
            *MEGATRON,
            "policy.megatron_cfg.pipeline_model_parallel_size=-1",
            "critic.megatron_cfg.pipeline_model_parallel_size=-1",
        ),
        "critic.megatron_cfg.pipeline_model_parallel_size",
        "positive integer",
        lambda: _parse({"pipeline_model_parallel_size": -1}, "critic"),
        megatron=True,
    ),
    Case(
        "MegatronOptions.transformer_impl",
        (*MEGATRON, "policy.megatron_cfg.transformer_impl=te"),
        "policy.megatron_cfg.transformer_impl",
        "'auto', 'transformer_engine', 'local'",
        lambda: _parse({"transformer_impl": "te"}),
        megatron=True,
    ),
    # --- what the Megatron backend refuses at set-up (world size, model, Transformer Engine)
    Case(
        "MegatronOptions.tensor_model_parallel_size",
        (
            *MEGATRON,
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "critic.megatron_cfg.tensor_model_parallel_size=2",
        ),
        "policy.megatron_cfg.tensor_model_parallel_size",
        "does not divide cluster.actor_gpus=1",
        None,
    ),
    Case(
        "MegatronOptions.pipeline_model_parallel_size",
        (
            *MEGATRON,
            "cluster.actor_gpus=2",
            "policy.megatron_cfg.pipeline_model_parallel_size=4",
            "critic.megatron_cfg.pipeline_model_parallel_size=4",
        ),
        "policy.megatron_cfg.pipeline_model_parallel_size",
        "does not divide cluster.actor_gpus=2",
        None,
    ),
    Case(
        "MegatronOptions.tensor_model_parallel_size",
        (
            *MEGATRON,
            "cluster.actor_gpus=4",
            "policy.megatron_cfg.tensor_model_parallel_size=4",
            "critic.megatron_cfg.tensor_model_parallel_size=4",
        ),
        "critic.megatron_cfg.tensor_model_parallel_size",
        "key/value heads",
        None,
    ),
    Case(
        "MegatronOptions.pipeline_model_parallel_size",
        (
            *MEGATRON,
            "cluster.actor_gpus=3",
            "policy.megatron_cfg.pipeline_model_parallel_size=3",
            "critic.megatron_cfg.pipeline_model_parallel_size=3",
        ),
        "policy.megatron_cfg.pipeline_model_parallel_size",
        "layers",
        None,
    ),
    Case(
        "MegatronOptions.transformer_impl",
        (*MEGATRON, "critic.megatron_cfg.transformer_impl=transformer_engine"),
        "critic.megatron_cfg.transformer_impl",
        "ppo-trainer[te]",
        None,
        megatron=True,
        no_te=True,
    ),
    Case(
        "MegatronOptions.fp8_param",
        (*MEGATRON, "policy.megatron_cfg.fp8_param=true"),
        "policy.megatron_cfg.fp8_param",
        "Transformer Engine",
        None,
        megatron=True,
        no_te=True,
    ),
    # With Transformer Engine present too: the local layer spec cannot hold FP8 parameters.
    Case(
        "MegatronOptions.fp8_param",
        (
            *MEGATRON,
            "policy.megatron_cfg.fp8_param=true",
            "policy.megatron_cfg.transformer_impl=local",
        ),
        "policy.megatron_cfg.fp8_param",
        "transformer_impl=local",
        None,
        megatron=True,
    ),
]

# Fields of the packages' configs that no YAML key reaches (the driver sets them, or the
# package's default holds), and fields the packages accept whatever the value.
NOT_FROM_YAML = {
    "ModelSpec.path": "policy/critic.model_path: any string; its files are checked by validate",
    "ModelSpec.vocab_size": "the tokenizer's (or the checkpoint's) vocabulary",
    "ModelSpec.max_position_embeddings": "the package default",
    "ModelSpec.rope_theta": "the package default",
    "ModelSpec.rms_norm_eps": "the package default",
    "ModelSpec.tie_word_embeddings": "the package default",
    "ModelSpec.seed": "run.seed (any int)",
    "model": "the ModelSpec rows",
    "backend": "'torch' or 'megatron', from megatron_cfg.enabled",
    "backend_options": "the megatron_cfg section: the parse_options rows",
    "device": "'auto'",
    "betas": "the package default",
    "adam_eps": "the package default",
    "lr_scheduler": "the package default (constant)",
    "decay_steps": "the package default (unused with constant)",
    "min_lr_ratio": "the package default",
    "offload_backend": "the package default (auto)",
    "placement_layout.rollout_external": "not a driver setting",
    "placement_layout.train_only": "not a driver setting",
    "placement_layout.rollout_only": "not a driver setting",
    "MegatronOptions.fp8_recipe": "accepted whatever the string (validate checks the names)",
    "MegatronOptions.seed": "not a driver key: the model seed",
    "MegatronOptions.prefix": "not a key: the role's section",
}


def _agreement_params() -> list[Any]:
    out = []
    for case in AGREEMENT:
        marks = [needs_megatron] if case.megatron else []
        if case.no_te:
            marks.append(pytest.mark.skipif(_te_available(), reason="TE and CUDA are here"))
        name = case.field.split(".")[-1]
        out.append(pytest.param(case, marks=marks, id=f"{case.key}:{name}:{case.overrides[-1]}"))
    return out


@pytest.mark.parametrize("case", _agreement_params())
def test_validate_refuses_what_the_packages_refuse(case: Case) -> None:
    if case.refuse is not None:
        with pytest.raises(ValueError):
            case.refuse()  # the package itself refuses this value
    errors = _errors(list(case.overrides))
    problems = [p for p in errors if p.key == case.key]
    assert problems, f"validate did not name {case.key}: {[str(p) for p in errors]}"
    text = str(problems[0])
    assert case.words in text and "fix:" in text, text


def _package_fields() -> set[str]:
    fields = {f"ModelSpec.{f.name}" for f in dataclasses.fields(ModelSpec)}
    for cls in (ActorConfig, CriticConfig):
        fields |= {f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)}
    fields |= {f"SamplerConfig.{f.name}" for f in dataclasses.fields(SamplerConfig)}
    fields |= {f"placement_layout.{n}" for n in inspect.signature(placement_layout).parameters}
    if _megatron_available():
        from ppo_trainer.megatron import MegatronOptions

        fields |= {f"MegatronOptions.{f.name}" for f in dataclasses.fields(MegatronOptions)}
    return fields


def test_every_package_field_is_in_the_agreement_table() -> None:
    # A field a package gains later must land in AGREEMENT (with the value it refuses) or
    # in NOT_FROM_YAML (with the reason YAML cannot reach it).
    covered = {c.field for c in AGREEMENT}
    unplaced = {
        f
        for f in _package_fields()
        if f not in covered and f not in NOT_FROM_YAML and f.split(".", 1)[1] not in NOT_FROM_YAML
    }
    assert not unplaced, sorted(unplaced)


def test_cli_validate_names_the_keys_the_trainer_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The disagreements, through the real command line.
    args = [
        "validate",
        "ppo.dual_clip=0.5",
        "ppo.eps_clip_high=-1",
        *MEGATRON,
        "policy.megatron_cfg.tensor_model_parallel_size=2",
        "critic.megatron_cfg.tensor_model_parallel_size=2",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    for key in (
        "ppo.dual_clip",
        "ppo.eps_clip_high",
        "policy.megatron_cfg.tensor_model_parallel_size",
    ):
        assert f"{key}=" in err, err


@needs_megatron
def test_cli_validate_accepts_transformer_impl(capsys: pytest.CaptureFixture[str]) -> None:
    # Supported by the backend, once refused as an unknown key by the driver.
    assert (
        main(
            [
                "validate",
                *MEGATRON,
                "policy.megatron_cfg.transformer_impl=local",
                "critic.megatron_cfg.transformer_impl=local",
            ]
        )
        == 0
    )
    assert "config OK" in capsys.readouterr().out


@needs_megatron
@pytest.mark.parametrize("impl", ["auto", "local"])
def test_megatron_options_train_builds_parse_as_the_backend_parses_them(impl: str) -> None:
    # What the Megatron backend does first at set-up (MegatronBackend.__init__):
    # parse_options(config.backend_options, role=...). The default config with Megatron
    # on once crashed here ("overlap_param_gather is unknown": the optimizer keys were
    # passed flat); the mapping now nests them and carries transformer_impl.
    from ppo_trainer.megatron import MegatronOptions, parse_options

    overrides = [*MEGATRON, *(f"{r}.megatron_cfg.transformer_impl={impl}" for r in ROLES)]
    cfg, report = load_config(None, overrides)
    assert report.ok, report.errors
    actor, critic = trainer_configs(cfg, vocab_size=20)
    for role, trainer_cfg in zip(ROLES, (actor, critic), strict=True):
        assert trainer_cfg.backend == "megatron"
        parsed = parse_options(trainer_cfg.backend_options, role=role)
        assert parsed == MegatronOptions(transformer_impl=impl, prefix=f"{role}.megatron_cfg")


# --------------------------------------------------------------------------- driver rules

# Keys no package reads (the driver's own ranges), non-finite floats, files, the reward.
CASES = [
    # --- NaN / infinity: refused for every float key, in the coercion step -------------
    pytest.param(["policy.lr=nan"], "policy.lr", "finite", id="nan-policy-lr"),
    pytest.param(["policy.lr=inf"], "policy.lr", "finite", id="inf-policy-lr"),
    pytest.param(["critic.lr=.nan"], "critic.lr", "finite", id="yaml-nan-critic-lr"),
    pytest.param(["ppo.dual_clip=.inf"], "ppo.dual_clip", "finite", id="inf-optional-float"),
    pytest.param(
        ["ppo.adv_estimator.gamma=-inf"], "ppo.adv_estimator.gamma", "finite", id="inf-gamma"
    ),
    pytest.param(
        ["rollout.reward_timeout_s=nan"], "rollout.reward_timeout_s", "finite", id="nan-timeout"
    ),
    # --- generation (the engines' SamplingParams) ----------------------------------------
    pytest.param(["rollout.top_p=1.5"], "rollout.top_p", "(0, 1]", id="top-p-above-1"),
    pytest.param(["rollout.top_p=0"], "rollout.top_p", "(0, 1]", id="top-p-zero"),
    pytest.param(["rollout.temperature=-1"], "rollout.temperature", ">= 0", id="temperature"),
    pytest.param(
        ["rollout.reward_timeout_s=-1"], "rollout.reward_timeout_s", ">= 0", id="reward-timeout"
    ),
    pytest.param(
        ["rollout.max_consecutive_group_failures=0"],
        "rollout.max_consecutive_group_failures",
        ">= 1",
        id="max-consecutive-failures",
    ),
    pytest.param(
        ["rollout.extra={max_count: 500}"], "rollout.extra.max_count", "[1, 99]", id="max-count"
    ),
    pytest.param(["async_rl.poll_interval_s=0"], "async_rl.poll_interval_s", "> 0", id="poll"),
    pytest.param(
        ["rollout.groups_per_call=0"], "rollout.groups_per_call", ">= 1", id="groups-per-call"
    ),
    pytest.param(["cluster.num_cpus=0"], "cluster.num_cpus", ">= 1", id="num-cpus"),
    pytest.param(["ppo.critic_ppo_epochs=0"], "ppo.critic_ppo_epochs", ">= 1", id="critic-ep"),
    pytest.param(
        ["ppo.num_generations_per_prompt=0"], "ppo.num_generations_per_prompt", ">= 1", id="gpp"
    ),
    pytest.param(["ppo.adv_estimator.lam=1.5"], "ppo.adv_estimator.lam", "[0, 1]", id="lam"),
    # --- Megatron rules of the driver (pure: also without the extra) ----------------------
    pytest.param(
        [*MEGATRON, "cluster.actor_gpus=2", "policy.megatron_cfg.tensor_model_parallel_size=2"],
        "critic.megatron_cfg.tensor_model_parallel_size",
        "same",
        id="critic-layout-differs",
    ),
    pytest.param(
        ["policy.megatron_cfg.enabled=true"],
        "critic.megatron_cfg.enabled",
        "same backend",
        id="critic-backend-differs",
    ),
    pytest.param(
        [*MEGATRON, "policy.megatron_cfg.optimizer.overlap_param_gather=true"],
        "policy.megatron_cfg.optimizer.overlap_param_gather",
        "use_distributed_optimizer",
        id="overlap-param-gather-without-distopt",
    ),
    pytest.param(
        [
            *MEGATRON,
            "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
            "policy.megatron_cfg.optimizer.overlap_param_gather=true",
        ],
        "policy.megatron_cfg.optimizer.overlap_param_gather",
        "not supported",
        id="overlap-param-gather-is-not-silently-ignored",
    ),
    pytest.param(
        ["cluster.logical_gpus=false"],
        "cluster.logical_gpus",
        "CUDA device(s)",
        id="real-gpus-on-a-machine-without-enough",
        marks=pytest.mark.skipif(
            torch.cuda.is_available() and torch.cuda.device_count() >= 2,
            reason="this machine has the GPUs the default layout reserves",
        ),
    ),
    pytest.param(
        [*MEGATRON, "policy.megatron_cfg.fp8_param=true", "policy.megatron_cfg.fp8_recipe=fp4"],
        "policy.megatron_cfg.fp8_recipe",
        "delayed",
        id="unknown-fp8-recipe",
    ),
    # --- files ---------------------------------------------------------------------------
    pytest.param(
        ["policy.model_path=/nonexistent/model"],
        "policy.model_path",
        "/nonexistent/model",
        id="policy-model-missing",
    ),
    pytest.param(
        ["critic.model_path=/nonexistent/critic"],
        "critic.model_path",
        "/nonexistent/critic",
        id="critic-model-missing",
    ),
    pytest.param(
        ["rollout.dataset_path=/nonexistent/data.jsonl"],
        "rollout.dataset_path",
        "/nonexistent/data.jsonl",
        id="dataset-missing",
    ),
    # --- the reward function (resolved with ppo_driver.rollout.load_reward_fn) ----------
    pytest.param(
        ["rollout.reward=no_such_module_xyz:score"], "rollout.reward", "import", id="reward-module"
    ),
    pytest.param(["rollout.reward=json"], "rollout.reward", "module:function", id="reward-form"),
    pytest.param(
        [f"rollout.reward={REWARDS}:missing"], "rollout.reward", "no callable", id="reward-attr"
    ),
    pytest.param(
        [f"rollout.reward={REWARDS}:NOT_CALLABLE"],
        "rollout.reward",
        "no callable",
        id="reward-not-callable",
    ),
    pytest.param(
        [f"rollout.reward={REWARDS}:positional"],
        "rollout.reward",
        "finish_reason",
        id="reward-signature",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "words"), CASES)
def test_validate_refuses_what_would_fail_after_ray_starts(
    overrides: list[str], key: str, words: str, reward_module: str
) -> None:
    problems = [p for p in _errors(overrides) if p.key == key]
    assert problems, f"no error for {key}: {_errors(overrides)}"
    text = str(problems[0])
    assert words in text and "fix:" in text and key in text, text


def test_cli_validate_refuses_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "ppo.dual_clip=0.5", "policy.lr=nan"]) == 1
    err = capsys.readouterr().err
    assert "2 error(s)" in err and "ppo.dual_clip" in err and "policy.lr" in err


def test_many_problems_all_reported_at_once(tmp_path: Path, reward_module: str) -> None:
    overrides = [
        "ppo.dual_clip=0.5",
        "ppo.eps_clip_high=-1",
        "ppo.value_clip=-1",
        "ppo.eps_clip=1.5",
        "ppo.entropy_coef=-1",
        "rollout.top_p=1.5",
        "rollout.temperature=-1",
        "policy.lr=nan",
        "critic.lr=inf",
        "policy.max_grad_norm=-1",
        "policy.weight_decay=-1",
        "policy.warmup_steps=-1",
        "critic.warmup_steps=-1",
        "policy.model_path=/nonexistent/model",
        "rollout.dataset_path=/nonexistent/data.jsonl",
        f"rollout.reward={REWARDS}:missing",
        "rollout.reward_timeout_s=-1",
        "rollout.max_consecutive_group_failures=0",
        "ppo.kl_estimator=k9",
        "ppo.loss_agg=mean",
        "policy.hidden_size=66",
        "critic.num_key_value_heads=3",
        "async_rl.sampler.name=fifo",
        "async_rl.sampler.max_staleness_versions=-1",
        "cluster.rollout_gpus=-1",
        *MEGATRON,
        "cluster.actor_gpus=2",
        "policy.megatron_cfg.tensor_model_parallel_size=2",  # the critic's differs
        # minimum above the batch AND an unaligned batch (micro-batch 8: alignment 2); the
        # batch stays above the default minimum, which validate falls back to when it
        # checks the sampler's other keys
        "ppo.num_prompts_per_step=63",
        "async_rl.min_groups_for_streaming_train=65",
        "policy.train_micro_batch_size=8",
    ]
    keys = {p.key for p in _errors(overrides)}
    expected = {o.partition("=")[0] for o in overrides} - {
        "policy.megatron_cfg.enabled",
        "critic.megatron_cfg.enabled",
        "cluster.actor_gpus",
        "policy.megatron_cfg.tensor_model_parallel_size",
        "policy.train_micro_batch_size",
    }
    expected.add("critic.megatron_cfg.tensor_model_parallel_size")
    assert expected <= keys, sorted(expected - keys)


def test_minimum_above_batch_and_unaligned_batch_both_reported() -> None:
    keys = [
        p.key
        for p in _errors(
            [
                "policy.train_micro_batch_size=8",
                "ppo.num_prompts_per_step=15",
                "async_rl.min_groups_for_streaming_train=17",
            ]
        )
    ]
    assert "async_rl.min_groups_for_streaming_train" in keys
    assert "ppo.num_prompts_per_step" in keys


def test_a_refused_minimum_does_not_hide_the_other_sampler_keys() -> None:
    # the refused minimum is retried with min(default 16, batch 8): the lookahead after it
    # is still judged (with the default 16 as the retry, the retry itself failed)
    errors = _errors(
        [
            "ppo.num_prompts_per_step=8",
            "async_rl.min_groups_for_streaming_train=0",
            "async_rl.sampler.max_lookahead_versions=-1",
        ]
    )
    keys = [p.key for p in errors]
    assert "async_rl.min_groups_for_streaming_train" in keys
    assert "async_rl.sampler.max_lookahead_versions" in keys, [str(p) for p in errors]


def test_deterministic_chunks_fix_names_both_ways_out() -> None:
    errors = _errors(
        ["async_rl.deterministic_chunks=true", "async_rl.sampler.max_lookahead_versions=2"]
    )
    (problem,) = [p for p in errors if p.key == "async_rl.deterministic_chunks"]
    assert problem.value is True
    assert "set async_rl.sampler.max_lookahead_versions=0" in problem.fix
    assert "async_rl.deterministic_chunks=false" in problem.fix
    assert not _errors(["async_rl.deterministic_chunks=true"])  # in_order, lookahead 0: fine


def test_temperature_zero_is_greedy_and_allowed() -> None:
    # rollout/_sampling.py: temperature 0 draws the arg-max token (greedy decoding).
    cfg, report = load_config(None, ["rollout.temperature=0"])
    assert report.ok and cfg.rollout.temperature == 0.0


def test_optional_clips_accept_null() -> None:
    cfg, report = load_config(
        None, ["ppo.value_clip=null", "ppo.dual_clip=3", "ppo.eps_clip_high=0.3"]
    )
    assert report.ok and cfg.ppo.value_clip is None and cfg.ppo.dual_clip == 3.0


def test_validate_refuses_non_finite_values_set_in_code() -> None:
    cfg = DriverConfig()
    cfg.policy.lr = float("nan")
    cfg.rollout.top_p = float("nan")
    keys = {p.key for p in validate(cfg).errors}
    assert {"policy.lr", "rollout.top_p"} <= keys


# --------------------------------------------------------------------------- files


def _hf_dir(path: Path, **config: Any) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_model_path_needs_config_json(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    problems = [
        p
        for p in _errors([f"policy.model_path={tmp_path / 'empty'}"])
        if p.key == "policy.model_path"
    ]
    assert problems and "config.json" in str(problems[0])


def test_a_config_json_transformers_cannot_read_is_refused(tmp_path: Path) -> None:
    # Valid JSON, but AutoConfig (what every worker calls) raises on it.
    model = make_model_dir(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}  # keys missing
    config["rope_parameters"] = config["rope_scaling"]
    (model / "config.json").write_text(json.dumps(config))
    problems = [
        str(p) for p in _errors([f"policy.model_path={model}"]) if p.key == "policy.model_path"
    ]
    assert problems and "transformers cannot read" in problems[0], problems


def test_existing_paths_are_accepted(tmp_path: Path, reward_module: str) -> None:
    # a real model directory: config.json, safetensors weights and its tokenizer
    model = make_model_dir(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a1:"}\n')
    _, report = load_config(
        None,
        [
            f"policy.model_path={model}",
            f"critic.model_path={model}",
            f"rollout.dataset_path={data}",
            f"rollout.reward={reward_module}:good",
        ],
    )
    assert report.ok, report.errors


def test_prompt_plus_new_tokens_must_fit_the_model_context(
    tmp_path: Path, reward_module: str
) -> None:
    # Found by a user: a GPT-2 (learned positions, n_positions) passed validate and
    # crashed at the first generation with an IndexError from its position embedding.
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    qwen = make_model_dir(tmp_path / "qwen")  # rotary, max_position_embeddings 512
    tok = AutoTokenizer.from_pretrained(qwen)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1 + 2 ="}\n' + json.dumps({"prompt": "1 + 2 = " * 8}) + "\n")
    longest = len(tok.encode("1 + 2 = " * 8))
    n = longest + 8  # GPT-2's n_positions
    gpt2 = tmp_path / "gpt2"
    eos = tok.eos_token_id
    config = GPT2Config(
        vocab_size=len(tok), n_positions=n, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    base = [f"rollout.dataset_path={data}", f"rollout.reward={reward_module}:good"]

    def report(model: Path, new: int) -> Any:
        return load_config(
            None, [*base, f"policy.model_path={model}", f"rollout.max_new_tokens={new}"],
            check=False,
        )[1]  # fmt: skip

    assert report(gpt2, 8).ok  # exactly the context: fine
    errors = [p for p in report(gpt2, 9).errors if p.key == "rollout.dataset_path"]
    assert len(errors) == 1, errors
    text = str(errors[0])
    assert f"{data}:2: {longest} tokens" in text and f"context of {n}" in text
    assert "rollout.max_new_tokens to at most 8" in text
    # rotary positions run past the context (worse): a warning, not an error
    rotary = report(qwen, 513 - longest)
    assert rotary.ok and [w for w in rotary.warnings if w.key == "rollout.dataset_path"]


def test_megatron_layout_uses_the_checkpoint_shape(tmp_path: Path) -> None:
    # The model's own config.json decides the head / layer counts, not policy.hidden_size.
    model = _hf_dir(
        tmp_path / "m",
        model_type="qwen2",
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=3,
        vocab_size=100,
        hidden_size=48,
    )
    errors = _errors(
        [
            *MEGATRON,
            "cluster.actor_gpus=2",
            f"policy.model_path={model}",
            f"critic.model_path={model}",
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "critic.megatron_cfg.tensor_model_parallel_size=2",
        ]
    )
    tp = [p for p in errors if p.key == "policy.megatron_cfg.tensor_model_parallel_size"]
    assert tp and "3" in tp[0].message and "config.json" in tp[0].message


@needs_megatron
@pytest.mark.parametrize(
    ("config", "words"),
    [
        pytest.param(
            {
                "model_type": "llama",
                "max_position_embeddings": 4096,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 1024,
                },
            },
            "rope_type='llama3'",
            id="llama3-rope",
        ),
        pytest.param({"model_type": "qwen2_moe"}, "model_type='qwen2_moe'", id="moe"),
        pytest.param(
            {"model_type": "llama", "attention_bias": True}, "attention_bias=True", id="o-bias"
        ),
    ],
)
def test_megatron_refuses_a_model_it_cannot_build(
    tmp_path: Path, config: dict[str, Any], words: str
) -> None:
    # The backend refuses these when it builds the model inside a Ray worker; validate
    # must refuse them first (the same ppo_trainer.megatron.model_config_problems).
    shape = {"num_attention_heads": 4, "num_hidden_layers": 2, "hidden_size": 32}
    model = _hf_dir(tmp_path / "m", vocab_size=64, **shape, **config)
    errors = _errors([*MEGATRON, f"critic.model_path={model}"])
    problems = [str(p) for p in errors if p.key == "critic.model_path" and words in str(p)]
    assert problems, errors
    assert "critic.megatron_cfg.enabled=false" in problems[0]
    assert not [p for p in errors if p.key == "policy.model_path"]  # the built-in: fine


# --------------------------------------------------------------------------- Megatron


@needs_megatron
def test_megatron_enabled_with_defaults_is_valid() -> None:
    # validate builds the trainer's configs exactly as `train` does and runs the megatron
    # backend's own option parser on them: a driver -> trainer mapping bug is caught here.
    _, report = load_config(None, MEGATRON)
    assert report.ok, report.errors


@needs_megatron
def test_bfloat16_with_megatron_reaches_every_model_spec() -> None:
    from ppo_driver.config import trainer_configs

    cfg, report = load_config(None, [*MEGATRON, "policy.dtype=bfloat16", "critic.dtype=bfloat16"])
    assert report.ok, report.errors
    actor, critic = trainer_configs(cfg, vocab_size=64)
    assert actor.model.dtype == critic.model.dtype == "bfloat16"


@needs_megatron
def test_megatron_tp2_on_two_gpus_is_valid() -> None:
    _, report = load_config(
        None,
        [
            *MEGATRON,
            "cluster.actor_gpus=2",
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "critic.megatron_cfg.tensor_model_parallel_size=2",
        ],
    )
    assert report.ok, report.errors


def test_missing_megatron_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # A real failed import: megatron-core made unimportable for this test only.
    for name in [
        m
        for m in sys.modules
        if m == "ppo_trainer.megatron" or m.startswith(("ppo_trainer.megatron.", "megatron."))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)
    problems = [p for p in _errors(MEGATRON) if p.key == "policy.megatron_cfg.enabled"]
    assert problems and "ppo-trainer[megatron]" in str(problems[0])


@needs_megatron
def test_both_refused_optimizer_keys_are_reported_at_once() -> None:
    # Both keys are fields of one `optimizer` argument of parse_options: refusing the
    # first must not reset the second before it is judged.
    p = "policy.megatron_cfg"
    errors = _errors(
        [
            *MEGATRON,
            f"{p}.fp8_param=true",
            f"{p}.fp8_recipe=mxfp8",
            f"{p}.optimizer.use_distributed_optimizer=true",
            f"{p}.optimizer.overlap_param_gather=true",
        ]
    )
    keys = {e.key for e in errors}
    assert {
        f"{p}.optimizer.use_distributed_optimizer",
        f"{p}.optimizer.overlap_param_gather",
    } <= keys, keys


@needs_megatron  # without megatron-core the missing extra is the one error reported
@pytest.mark.skipif(_te_available(), reason="Transformer Engine and CUDA are present here")
def test_fp8_params_need_transformer_engine() -> None:
    problems = [
        p
        for p in _errors([*MEGATRON, "policy.megatron_cfg.fp8_param=true"])
        if p.key == "policy.megatron_cfg.fp8_param"
    ]
    assert problems and "Transformer Engine" in str(problems[0])


@needs_megatron
def test_fp8_recipe_without_fp8_params_warns() -> None:
    _, report = load_config(None, [*MEGATRON, "policy.megatron_cfg.fp8_recipe=delayed"])
    assert report.ok, report.errors
    assert [w.key for w in report.warnings] == ["policy.megatron_cfg.fp8_recipe"]
    assert "fp8_param is false" in str(report.warnings[0])


def test_megatron_settings_of_a_torch_model_warn() -> None:
    # With megatron_cfg.enabled=false the trainer never sees the section: nothing in it
    # is refused (the trainer would not), each changed setting is a warning.
    _, report = load_config(
        None,
        [
            "policy.megatron_cfg.use_megatron_fsdp=true",
            "critic.megatron_cfg.transformer_impl=local",
            "critic.megatron_cfg.optimizer.overlap_param_gather=true",
        ],
    )
    assert report.ok, report.errors
    assert [w.key for w in report.warnings] == [
        "policy.megatron_cfg.use_megatron_fsdp",
        "critic.megatron_cfg.transformer_impl",
        "critic.megatron_cfg.optimizer.overlap_param_gather",
    ]
    assert all("enabled is false" in str(w) for w in report.warnings)


# --------------------------------------------------------------------------- config files


@pytest.mark.parametrize(
    ("content", "words"),
    [
        pytest.param(b"ppo:\n  eps_clip: 0.2 \xff\xfe\n", "UTF-8", id="not-utf8"),
        pytest.param(b"- a\n- b\n", "mapping", id="not-a-mapping"),
        pytest.param(b"ppo: [\n", "YAML", id="bad-yaml"),
    ],
)
def test_bad_config_file_is_a_config_error(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert str(path) in text and words in text and "fix:" in text


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_unreadable_config_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "c.yaml"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "fix:" in str(info.value)


def test_cli_reports_a_non_utf8_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    assert main(["validate", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "UTF-8" in err


# --------------------------------------------------------------------------- defaults


def test_empty_yaml_gets_the_shipped_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    empty, _ = load_config(path)
    shipped, _ = load_config(None)
    assert empty == shipped == DriverConfig()


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "extra":
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_default_yaml_lists_every_key_with_the_dataclass_default() -> None:
    # One source of defaults: the dataclasses. The shipped YAML is a complete, commented
    # template of them, compared key by key so the two can never drift apart.
    shipped = _leaves(yaml.safe_load(default_config_path().read_text(encoding="utf-8")))
    code = _leaves(dataclasses.asdict(DriverConfig()))
    assert sorted(shipped) == sorted(code)
    for key, value in code.items():
        assert shipped[key] == value, f"{key}: default.yaml {shipped[key]!r} != code {value!r}"


# ------------------------------------------- rules a mutation sweep found untested


@pytest.mark.skipif(torch.cuda.is_available(), reason="memory_saver runs where there is CUDA")
@pytest.mark.parametrize("spelling", ["memory_saver", "torch_memory_saver"])
def test_memory_saver_needs_cuda_in_either_spelling(spelling: str) -> None:
    """The trainer reads ``torch_memory_saver`` as ``memory_saver``: validate must judge
    it the same (it used to skip the alias, so train failed after Ray started)."""
    problems = _errors([f"policy.offload_backend={spelling}"])
    assert [p.key for p in problems] == ["policy.offload_backend"], problems
    assert "needs CUDA" in str(problems[0]) and "host_copy" in problems[0].fix


def test_length_order_is_refused_for_sglang() -> None:
    # the length order needs the embedded engine's progress reports (driver README)
    keys = [p.key for p in _errors(["async_rl.block_order=length", "rollout.engine=sglang"])]
    assert "async_rl.block_order" in keys


def test_a_block_order_without_fixed_blocks_is_a_warning() -> None:
    _, report = load_config(
        None, ["async_rl.block_order=dispatch", "async_rl.deterministic_chunks=false"]
    )
    assert report.ok
    assert [w.key for w in report.warnings] == ["async_rl.block_order"]


def test_a_minimum_equal_to_an_unaligned_batch_reports_both_keys() -> None:
    """The minimum may equal the batch (full batch), but not when neither is a multiple
    of the micro-batch's groups (8 samples / 4 per group = 2): both keys are named."""
    keys = [
        p.key
        for p in _errors(
            [
                "ppo.num_prompts_per_step=15",
                "async_rl.min_groups_for_streaming_train=15",
                "policy.train_micro_batch_size=8",
            ]
        )
    ]
    assert {"ppo.num_prompts_per_step", "async_rl.min_groups_for_streaming_train"} <= set(keys)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("ppo.critic_ppo_epochs=true", "ppo.critic_ppo_epochs"),
        ("policy.lr=true", "policy.lr"),
    ],
)
def test_a_boolean_is_not_a_number(override: str, key: str) -> None:
    assert [p.key for p in _errors([override])] == [key]


def test_a_misspelt_key_gets_its_full_spelling() -> None:
    (problem,) = _errors(["ppo.num_prompt_per_step=8"])
    assert problem.key == "ppo.num_prompt_per_step"
    assert "did you mean ppo.num_prompts_per_step?" in problem.fix


def test_a_refused_key_is_reported_once() -> None:
    """The driver's own check and the package's check of the same field are merged."""
    assert [p.key for p in _errors(["ppo.loss_agg=mean"])] == ["ppo.loss_agg"]
    cfg = DriverConfig()
    cfg.policy.lr = float("nan")
    assert [p.key for p in validate(cfg).errors] == ["policy.lr"]


def test_an_infinite_value_set_in_code_is_refused() -> None:
    cfg = DriverConfig()
    cfg.rollout.temperature = float("inf")  # its range (>= 0) alone would let it through
    assert "rollout.temperature" in {p.key for p in validate(cfg).errors}


def test_as_many_cpus_as_bundles_is_enough() -> None:
    """One training and three generation logical GPUs are 4 placement bundles of one
    CPU each: 4 CPUs are enough, 3 are refused (only fewer CPUs than bundles is)."""
    assert not _errors(["cluster.rollout_gpus=3", "cluster.num_cpus=4"])
    assert [p.key for p in _errors(["cluster.rollout_gpus=3", "cluster.num_cpus=3"])] == [
        "cluster.num_cpus"
    ]
