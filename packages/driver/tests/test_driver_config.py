"""Config loading and validation: every rule gives a clear error naming key, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from ppo_driver.cli import main
from ppo_driver.config import ConfigError, load_config


def test_default_config_is_valid_and_streams() -> None:
    cfg, report = load_config()
    assert report.ok and not report.warnings
    assert cfg.streaming
    assert cfg.ppo.ppo_epochs == 1


def test_yaml_file_and_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "ppo:\n  num_prompts_per_step: 32\nasync_rl:\n  min_groups_for_streaming_train: 8\n"
    )
    cfg, _ = load_config(
        path, ["ppo.num_prompts_per_step=64", "async_rl.sampler.name=ready_first", "policy.lr=2e-4"]
    )
    assert cfg.ppo.num_prompts_per_step == 64
    assert cfg.async_rl.min_groups_for_streaming_train == 8
    assert cfg.async_rl.sampler.name == "ready_first"
    assert cfg.policy.lr == 2e-4  # parsed from "2e-4": the same float64, exactly


FULL = "async_rl.min_groups_for_streaming_train=16"  # batch 16 in the default: full-batch


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        pytest.param(
            ["ppo.ppo_epochs=2"], "ppo.ppo_epochs", "ppo_epochs=1", id="streaming-needs-one-epoch"
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
            ["cluster.rollout_gpus=0"],
            "cluster.colocate",
            "own devices",
            id="streaming-no-rollout-gpus",
        ),
        pytest.param(
            ["policy.megatron_cfg.use_megatron_fsdp=true"],
            "policy.megatron_cfg.use_megatron_fsdp",
            "classic",
            id="megatron-fsdp",
        ),
        pytest.param(
            [FULL, "critic.megatron_cfg.use_megatron_fsdp=true"],
            "critic.megatron_cfg.use_megatron_fsdp",
            "classic",
            id="megatron-fsdp-critic-full-batch",
        ),
        pytest.param(
            [
                "policy.megatron_cfg.fp8_param=true",
                "policy.megatron_cfg.fp8_recipe=mxfp8",
                "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
                "policy.megatron_cfg.optimizer.overlap_param_gather=false",
            ],
            "policy.megatron_cfg.optimizer.use_distributed_optimizer",
            "MXFP8",
            id="mxfp8-distributed-optimizer",
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
            ["async_rl.min_groups_for_streaming_train=17"],
            "async_rl.min_groups_for_streaming_train",
            "exceeds the batch",
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
        pytest.param(["ppo.loss_agg=mean"], "ppo.loss_agg", "token or sample", id="loss-agg"),
        pytest.param(["oops"], "oops", "section.key=value", id="bad-override"),
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


def test_streaming_accepts_token_aggregation() -> None:
    cfg, report = load_config(None, ["ppo.loss_agg=token"])
    assert report.ok and cfg.streaming


def test_full_batch_allows_several_epochs_and_colocated_generation() -> None:
    cfg, report = load_config(None, [FULL, "ppo.ppo_epochs=3", "cluster.colocate=true"])
    assert report.ok and not cfg.streaming


def test_all_problems_reported_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["validate", "ppo.ppo_epochs=2", "ppo.kl_coef=0.1", "cluster.colocate=true", "ppo.bogus=1"]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "4 error(s)" in err
    for key in ("ppo.ppo_epochs", "ppo.kl_coef", "cluster.colocate", "ppo.bogus"):
        assert key in err


@pytest.mark.parametrize("minimum", range(11, 16))
def test_minimum_that_never_splits_warns(minimum: int) -> None:
    _, report = load_config(None, [f"async_rl.min_groups_for_streaming_train={minimum}"])
    assert report.ok
    assert [w.key for w in report.warnings] == ["async_rl.min_groups_for_streaming_train"]
    assert "ONE chunk" in str(report.warnings[0])


@pytest.mark.parametrize("minimum", [1, 4, 10, 16])
def test_minimum_that_can_split_or_full_batch_does_not_warn(minimum: int) -> None:
    _, report = load_config(None, [f"async_rl.min_groups_for_streaming_train={minimum}"])
    assert report.ok and not report.warnings


def test_train_refuses_invalid_config_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "ppo.ppo_epochs=2"]) == 1
    assert "refusing to start" in capsys.readouterr().err
