"""Config loading and validation: every rule gives a clear error naming key, value and fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from ppo_driver.cli import main
from ppo_driver.config import (
    ConfigError,
    DriverConfig,
    cluster_layout,
    load_config,
    local_num_cpus,
    trainer_configs,
)


def test_default_config_is_valid_and_streams() -> None:
    cfg, report = load_config()
    assert report.ok and not report.warnings
    assert cfg.streaming
    assert cfg.ppo.ppo_epochs == 4  # the project's extension: K epochs while streaming
    assert cfg.ppo.adv_estimator.normalization == "previous_step"


@pytest.mark.parametrize(
    ("overrides", "per_call"),
    [
        pytest.param([], 16, id="embedded"),
        pytest.param(["rollout.decode_delay_s=0.1"], 1, id="emulated-device"),
        pytest.param(["rollout.engine=sglang"], 1, id="sglang"),
        pytest.param(["rollout.groups_per_call=8"], 8, id="given"),
        pytest.param(["rollout.groups_per_call=1"], 1, id="given-one"),
    ],
)
def test_groups_per_call(overrides: list[str], per_call: int) -> None:
    """null: several groups per call only where the calls' CPU is the trainers' (the
    embedded engine); one per call where groups must stream as they finish."""
    cfg, _ = load_config(None, overrides, check=False)
    assert cfg.groups_per_call == per_call


def test_streaming_allows_several_epochs_and_the_kl_loss() -> None:
    """Epochs 2..K run over the kept chunks (the reference log-probs are kept with the
    old ones), so neither the epoch count nor a KL loss is refused while streaming."""
    for overrides in (["ppo.ppo_epochs=1"], ["ppo.ppo_epochs=8", "ppo.kl_loss_coef=0.05"]):
        cfg, report = load_config(None, overrides)
        assert report.ok and cfg.streaming, report


def test_yaml_file_and_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "ppo:\n  num_prompts_per_step: 32\nasync_rl:\n  min_groups_for_streaming_train: 8\n"
    )
    cfg, _ = load_config(
        path,
        [
            "ppo.num_prompts_per_step=64",
            "async_rl.sampler.name=ready_first",
            "async_rl.deterministic_chunks=false",  # in_order only
            "policy.lr=2e-4",
        ],
    )
    assert cfg.ppo.num_prompts_per_step == 64
    assert cfg.async_rl.min_groups_for_streaming_train == 8
    assert cfg.async_rl.sampler.name == "ready_first"
    assert cfg.policy.lr == 2e-4  # parsed from "2e-4": the same float64, exactly


FULL = "async_rl.min_groups_for_streaming_train=64"  # batch 64 in the default: full-batch


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        pytest.param(
            ["ppo.adv_estimator.normalization=batch"],
            "ppo.adv_estimator.normalization",
            "previous_step or chunk",
            id="unknown-normalization",
        ),
        pytest.param(
            ["async_rl.sampler.name=fifo"],
            "async_rl.sampler.name",
            "in_order",
            id="unknown-sampler",
        ),
        pytest.param(
            ["cluster.colocate=true"],
            "cluster.colocate",
            "own devices",
            id="streaming-colocated-generation",
        ),
        pytest.param(
            [FULL, "cluster.colocate=true", "async_rl.sampler.max_lookahead_versions=1"],
            "async_rl.sampler.max_lookahead_versions",
            "release their memory while the actor and the critic train",
            id="colocated-lookahead",
        ),
        pytest.param(
            ["cluster.rollout_gpus=0"],
            "cluster.rollout_gpus",
            "generation runs locally",
            id="streaming-no-rollout-gpus",
        ),
        pytest.param(["ppo.kl_coef=0.05"], "ppo.kl_coef", "kl_loss_coef", id="reward-level-kl"),
        pytest.param(
            ["ppo.num_prompts_per_step=15"],
            "ppo.num_prompts_per_step",
            "multiple of 2",
            id="batch-alignment",
        ),
        pytest.param(
            ["async_rl.min_groups_for_streaming_train=5"],
            "async_rl.min_groups_for_streaming_train",
            "multiple of 2",
            id="minimum-alignment",
        ),
        pytest.param(
            ["ppo.num_prompts_per_step=16", "async_rl.min_groups_for_streaming_train=17"],
            "async_rl.min_groups_for_streaming_train",
            "exceeds ppo.num_prompts_per_step",
            id="minimum-above-batch",
        ),
        pytest.param(
            ["ppo.num_prompt_per_step=8"],
            "ppo.num_prompt_per_step",
            "num_prompts_per_step",
            id="typo",
        ),
        pytest.param(
            ["ppo.critic_ppo_epochs=two"], "ppo.critic_ppo_epochs", "int", id="wrong-type"
        ),
        pytest.param(["ppo.loss_agg=mean"], "ppo.loss_agg", "'token', 'sample'", id="loss-agg"),
        pytest.param(["oops"], "oops", "section.key=value", id="bad-override"),
        pytest.param(["my.yaml"], "--config", "pass it as --config my.yaml", id="file-as-override"),
        pytest.param(
            ["policy.dtype=bfloat16"],
            "policy.dtype",
            "set policy.megatron_cfg.enabled=true",
            id="bf16-without-master-weights",
        ),
        pytest.param(["critic.dtype=float16"], "critic.dtype", "loss scaling", id="fp16"),
        pytest.param(
            ["cluster.actor_gpus=2", "ppo.critic_mini_batch_size=5"],
            "ppo.critic_mini_batch_size",
            "e.g. 4 or 6",
            id="critic-mini-batch-over-ranks",
        ),
        pytest.param(
            ["cluster.rollout_gpus=3", "cluster.num_cpus=3"],
            "cluster.num_cpus",
            "at least 4",
            id="fewer-cpus-than-bundles",
        ),
    ],
)
def test_each_invalid_config_names_key_value_and_fix(
    overrides: list[str], key: str, words: str
) -> None:
    # Alignment 2 for batch/min tests: 4 generations per prompt, micro-batch 8 on one rank.
    extra = (
        ["policy.train_micro_batch_size=8"] if "alignment" in words or "multiple" in words else []
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, [*extra, *overrides])
    problems = [p for p in info.value.problems if p.key == key]
    assert problems, str(info.value)
    text = str(problems[0])
    assert words in text and "fix:" in text and key in text


def test_default_local_cpus_cover_every_bundle() -> None:
    # 1 + 8 bundles of 1 GPU + 1 CPU: the default CPUs must let the placement group form.
    cfg, _ = load_config(None, ["cluster.rollout_gpus=8"])
    assert local_num_cpus(cfg, cluster_layout(cfg)) == 9


def test_streaming_accepts_token_aggregation() -> None:
    cfg, report = load_config(None, ["ppo.loss_agg=token"])
    assert report.ok and cfg.streaming


def test_full_batch_allows_several_epochs_and_colocated_generation() -> None:
    cfg, report = load_config(None, [FULL, "ppo.ppo_epochs=3", "cluster.colocate=true"])
    assert report.ok and not cfg.streaming


def test_all_problems_reported_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["validate", "ppo.ppo_epochs=0", "ppo.kl_coef=0.1", "cluster.colocate=true", "ppo.bogus=1"]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "4 error(s)" in err
    for key in ("ppo.ppo_epochs", "ppo.kl_coef", "cluster.colocate", "ppo.bogus"):
        assert key in err


BATCH16 = "ppo.num_prompts_per_step=16"  # the document's example: 11-15 of 16 never split


@pytest.mark.parametrize("minimum", range(11, 16))
def test_minimum_that_never_splits_warns(minimum: int) -> None:
    _, report = load_config(None, [BATCH16, f"async_rl.min_groups_for_streaming_train={minimum}"])
    assert report.ok
    assert [w.key for w in report.warnings] == ["async_rl.min_groups_for_streaming_train"]
    assert "ONE chunk" in str(report.warnings[0])


@pytest.mark.parametrize("minimum", [1, 4, 10, 16])
def test_minimum_that_can_split_or_full_batch_does_not_warn(minimum: int) -> None:
    _, report = load_config(None, [BATCH16, f"async_rl.min_groups_for_streaming_train={minimum}"])
    assert report.ok and not report.warnings


def test_train_refuses_invalid_config_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "ppo.ppo_epochs=0"]) == 1
    assert "refusing to start" in capsys.readouterr().err


def test_python_api_train_gets_the_cli_refusals_before_ray(tmp_path: Path) -> None:
    # train(DriverConfig(...)) validates first: every problem, before the run directory,
    # the lock or Ray exist (the same refusals as `ppo-driver train`).
    import ray
    from ppo_driver import train

    cfg = DriverConfig()
    cfg.ppo.ppo_epochs = 0
    cfg.policy.lr = -1.0
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        train(cfg, run_dir=run_dir)
    assert {p.key for p in info.value.problems} >= {"ppo.ppo_epochs", "policy.lr"}
    assert not ray.is_initialized()
    assert not run_dir.exists()


def test_a_valid_config_is_a_frozen_copy_of_what_was_judged() -> None:
    from ppo_driver.config import ValidConfig, validate, validated

    cfg = DriverConfig()
    valid = validated(cfg)
    assert isinstance(valid, ValidConfig) and validated(valid) is valid
    cfg.ppo.ppo_epochs = 0  # an edit after validation does not reach the validated copy
    assert valid.config.ppo.ppo_epochs == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        valid.config = cfg  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"ppo\.ppo_epochs"):
        validate(cfg).valid()


# --------------------------------------------------------------------------- the mesh


def _mesh(*, gpus: int, tp: int = 1, pp: int = 1, megatron: bool = True) -> DriverConfig:
    cfg = DriverConfig()
    cfg.cluster.actor_gpus = gpus
    for m in (cfg.policy, cfg.critic):
        m.megatron_cfg.enabled = megatron
        m.megatron_cfg.tensor_model_parallel_size = tp
        m.megatron_cfg.pipeline_model_parallel_size = pp
    return cfg


@pytest.mark.parametrize(
    ("gpus", "tp", "pp", "megatron", "dp"),
    [
        pytest.param(4, 1, 1, True, 4, id="dp4"),
        pytest.param(4, 2, 1, True, 2, id="tp2"),
        pytest.param(8, 2, 2, True, 2, id="tp2-pp2"),
        pytest.param(4, 4, 1, True, 1, id="tp4"),
        pytest.param(4, 2, 2, False, 4, id="torch-ignores-megatron-sizes"),
    ],
)
def test_dp_size_is_gpus_over_model_parallel(
    gpus: int, tp: int, pp: int, megatron: bool, dp: int
) -> None:
    cfg = _mesh(gpus=gpus, tp=tp, pp=pp, megatron=megatron)
    assert cfg.dp_size("policy") == cfg.dp_size("actor") == cfg.dp_size("critic") == dp
    assert cfg.model_parallel_sizes("policy") == ((tp, pp) if megatron else (1, 1))


def test_dp_size_refuses_a_mesh_the_gpus_cannot_hold() -> None:
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        _mesh(gpus=3, tp=2).dp_size("critic")


def test_group_alignment_uses_each_models_data_parallel_size() -> None:
    # 4 GPUs, TP=2: two data-parallel ranks per model. One generation per prompt: a
    # chunk must split over 2 ranks, not over the 4 GPUs.
    cfg = _mesh(gpus=4, tp=2)
    cfg.ppo.num_generations_per_prompt = 1
    assert cfg.group_alignment == 2
    cfg.policy.train_micro_batch_size = 3  # 2 ranks x 3 samples
    assert cfg.group_alignment == 6


def test_alignment_problem_names_the_data_parallel_sizes() -> None:
    _, report = load_config(
        None,
        [
            "policy.megatron_cfg.enabled=true",
            "critic.megatron_cfg.enabled=true",
            "cluster.actor_gpus=4",
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "critic.megatron_cfg.tensor_model_parallel_size=2",
            "ppo.num_generations_per_prompt=1",
            "ppo.num_prompts_per_step=6",  # aligned for dp 2, not for the 4 GPUs
            "async_rl.min_groups_for_streaming_train=2",
        ],
        check=False,
    )
    keys = [p.key for p in report.errors]
    assert "ppo.num_prompts_per_step" not in keys, report.errors
    _, report = load_config(
        None,
        [
            "cluster.actor_gpus=4",
            "ppo.num_generations_per_prompt=1",
            "ppo.num_prompts_per_step=6",
            "async_rl.min_groups_for_streaming_train=2",
        ],
        check=False,
    )
    [problem] = [p for p in report.errors if p.key == "ppo.num_prompts_per_step"]
    assert "policy 4, critic 4" in problem.message and "multiple of 4" in problem.fix


def test_trainer_configs_default_micro_batch_is_one_data_parallel_ranks_share() -> None:
    cfg = _mesh(gpus=4, tp=2)
    cfg.ppo.num_prompts_per_step = 16  # 16 prompts x 4 generations over 2 data-parallel ranks
    actor, critic = trainer_configs(cfg, vocab_size=20)
    assert actor.micro_batch_size == critic.micro_batch_size == 32
    assert actor.backend == critic.backend == "megatron"
    assert actor.model.seed + 1 == critic.model.seed
    cfg.critic.train_micro_batch_size = 0  # refused by the trainer, not read as "null"
    with pytest.raises(ValueError, match=r"critic\.micro_batch_size=0"):
        trainer_configs(cfg, vocab_size=20)


def test_a_partial_section_keeps_the_defaults_of_its_parent(tmp_path: Path) -> None:
    """``critic: {train_micro_batch_size: 64}`` (configs/full_batch.yaml does this) keeps
    every other critic default, its own lr (3e-3) included, not the bare ModelConfig's
    (the policy's 5e-4); the same through a dotted override."""
    path = tmp_path / "c.yaml"
    path.write_text("critic:\n  train_micro_batch_size: 64\nppo:\n  adv_estimator:\n    lam: 0.9\n")
    cfg, _ = load_config(path, [])
    assert cfg.critic.train_micro_batch_size == 64
    assert cfg.critic.lr == DriverConfig().critic.lr == 3e-3 != cfg.policy.lr
    assert cfg.ppo.adv_estimator.lam == 0.9 and cfg.ppo.adv_estimator.normalize_advantages
    cfg, _ = load_config(None, ["critic.train_micro_batch_size=64"])
    assert cfg.critic.lr == 3e-3


@pytest.mark.parametrize(
    ("overrides", "actor_micro", "critic_micro"),
    [
        # the default: 64 prompts x 4 samples, blocks of 16 groups = 64 rows each
        pytest.param([], 64, 64, id="default"),
        pytest.param(["cluster.actor_gpus=2"], 32, 32, id="dp2"),
        pytest.param(["async_rl.min_groups_for_streaming_train=20"], 80, 80, id="min-20"),
        pytest.param(["async_rl.deterministic_chunks=false"], 256, 256, id="by-arrival"),
        pytest.param([FULL], 256, 256, id="full-batch"),
        # an explicit size stays; the other model's null is still its block share
        pytest.param(["policy.train_micro_batch_size=32"], 32, 64, id="explicit"),
    ],
)
def test_deterministic_blocks_set_the_default_micro_batch(
    overrides: list[str], actor_micro: int, critic_micro: int
) -> None:
    """With deterministic chunks while streaming, a null micro-batch size is one rank's
    share of a fixed block (so a chunk of several blocks is computed block by block);
    otherwise one rank's share of the step; an explicit size stays."""
    cfg, _ = load_config(None, overrides)
    actor, critic = trainer_configs(cfg, vocab_size=20)
    assert (actor.micro_batch_size, critic.micro_batch_size) == (actor_micro, critic_micro)


DELAY = "rollout.decode_delay_s=0.1"


@pytest.mark.parametrize(
    ("overrides", "fixed", "order"),
    [
        pytest.param([], True, "dispatch", id="default"),
        pytest.param([DELAY], True, "length", id="generation-devices"),
        pytest.param(
            [DELAY, "async_rl.block_order=dispatch"], False, "dispatch", id="devices-dispatch"
        ),
        pytest.param(["async_rl.block_order=length"], True, "length", id="length"),
        pytest.param(["async_rl.sampler.name=ready_first"], False, "dispatch", id="ready-first"),
        pytest.param(
            [DELAY, "async_rl.sampler.max_lookahead_versions=1"], False, "length", id="look-ahead"
        ),
        pytest.param(["async_rl.deterministic_chunks=false"], False, "dispatch", id="false"),
        pytest.param(
            [DELAY, "async_rl.block_order=dispatch", "async_rl.deterministic_chunks=true"],
            True,
            "dispatch",
            id="true",
        ),
    ],
)
def test_deterministic_chunks_null_is_fixed_blocks_only_where_they_cost_nothing(
    overrides: list[str], fixed: bool, order: str
) -> None:
    """null: fixed blocks where they keep the overlap and the sampler allows them. With
    generation on the trainers' cores (training-bound: the blocks are all done when a
    step starts) in dispatch order; with generation on devices of its own in length
    order (a block fills as its groups finish), and by arrival where the blocks would
    be in dispatch order (a block would wait for its slowest group). An explicit value
    stays, and true with ``ready_first`` is refused."""
    cfg, _ = load_config(None, overrides)
    assert cfg.async_rl.deterministic_chunks is (
        None if "deterministic" not in str(overrides) else fixed
    )
    assert cfg.fixed_chunks is fixed
    assert cfg.block_order == order
    actor, _critic = trainer_configs(cfg, vocab_size=20)
    assert actor.micro_batch_size == (64 if fixed else 256)  # a block, or the step
    with pytest.raises(ConfigError, match=r"async_rl\.deterministic_chunks=false"):
        load_config(
            None, ["async_rl.sampler.name=ready_first", "async_rl.deterministic_chunks=true"]
        )


def test_ready_blocks_merge_with_fixed_blocks_on_any_data_parallel_size() -> None:
    """Each rank gets its share of every block of a chunk (``Rows(blocks=...)``), so
    merged blocks put on every rank what one block per chunk would: they merge with
    several ranks too; never with chunks cut as groups arrive, or when turned off."""
    from ppo_driver.pump import merges_ready_blocks

    assert merges_ready_blocks(load_config(None, [])[0])
    assert merges_ready_blocks(load_config(None, ["cluster.actor_gpus=2"])[0])
    assert not merges_ready_blocks(load_config(None, ["async_rl.merge_ready_blocks=false"])[0])
    arrival = ["async_rl.deterministic_chunks=false", "rollout.decode_delay_s=0.1"]
    assert not merges_ready_blocks(load_config(None, arrival)[0])


def test_a_yaml_syntax_error_names_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("a: 1\nb: 2\n\tc: 3\n")  # a tab cannot start a YAML token
    with pytest.raises(ConfigError, match="line 3, column 1"):
        load_config(path, [])
