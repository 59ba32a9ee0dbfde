"""``ppo-driver validate`` refuses, before Ray starts, every value that the trainer, the
sampler, the placement or the engines would refuse later, and reports all of them at once.

Each row is a config the old validate called "OK" and that then failed after Ray had
started (or silently misbehaved); the test asserts the problem names its YAML key and
carries a fix.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ppo_driver.cli import main
from ppo_driver.config import (
    ConfigError,
    ConfigProblem,
    DriverConfig,
    default_config_path,
    load_config,
    validate,
)

FULL = "async_rl.min_groups_for_streaming_train=16"  # batch 16 in the default: full-batch
MEGATRON = ["policy.megatron_cfg.enabled=true", "critic.megatron_cfg.enabled=true"]
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


CASES = [
    # --- PPO loss constants (ppo_trainer.ActorConfig / CriticConfig refuse them) -----
    pytest.param(["ppo.dual_clip=0.5"], "ppo.dual_clip", "> 1", id="dual-clip-not-above-1"),
    pytest.param(["ppo.eps_clip_high=-1"], "ppo.eps_clip_high", "> 0", id="eps-clip-high-neg"),
    pytest.param(["ppo.value_clip=-1"], "ppo.value_clip", "> 0", id="value-clip-negative"),
    pytest.param(["ppo.eps_clip=1.5"], "ppo.eps_clip", "(0, 1)", id="eps-clip-above-1"),
    pytest.param(["ppo.eps_clip=0"], "ppo.eps_clip", "(0, 1)", id="eps-clip-zero"),
    pytest.param(["ppo.entropy_coef=-1"], "ppo.entropy_coef", ">= 0", id="entropy-coef-neg"),
    # --- optimizer settings of both models ---------------------------------------------
    pytest.param(["policy.max_grad_norm=-1"], "policy.max_grad_norm", "> 0", id="policy-gn"),
    pytest.param(["critic.max_grad_norm=0"], "critic.max_grad_norm", "> 0", id="critic-gn"),
    pytest.param(["policy.weight_decay=-1"], "policy.weight_decay", ">= 0", id="policy-wd"),
    pytest.param(["critic.weight_decay=-1"], "critic.weight_decay", ">= 0", id="critic-wd"),
    pytest.param(["policy.warmup_steps=-1"], "policy.warmup_steps", ">= 0", id="policy-warmup"),
    pytest.param(["critic.warmup_steps=-5"], "critic.warmup_steps", ">= 0", id="critic-warmup"),
    pytest.param(["critic.lr=0"], "critic.lr", "> 0", id="critic-lr-zero"),
    # --- model shape (ppo_trainer.ModelSpec) -------------------------------------------
    pytest.param(
        ["policy.hidden_size=66"], "policy.hidden_size", "num_attention_heads", id="hidden-heads"
    ),
    pytest.param(
        ["critic.num_key_value_heads=3"],
        "critic.num_key_value_heads",
        "num_attention_heads",
        id="kv-heads-divide-heads",
    ),
    pytest.param(["policy.num_hidden_layers=0"], "policy.num_hidden_layers", ">= 1", id="layers"),
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
    pytest.param(["cluster.num_cpus=0"], "cluster.num_cpus", ">= 1", id="num-cpus"),
    # --- placement (ppo_placement.placement_layout) --------------------------------------
    pytest.param(
        [FULL, "cluster.rollout_gpus=0"], "cluster.rollout_gpus", "rollout", id="no-rollout-gpus"
    ),
    # --- Megatron layout (pure arithmetic: also without the extra) -----------------------
    pytest.param(
        [*MEGATRON, "policy.megatron_cfg.tensor_model_parallel_size=2"],
        "policy.megatron_cfg.tensor_model_parallel_size",
        "cluster.actor_gpus",
        id="megatron-tp2-on-one-gpu",
    ),
    pytest.param(
        [
            *MEGATRON,
            "cluster.actor_gpus=4",
            "policy.megatron_cfg.tensor_model_parallel_size=4",
            "critic.megatron_cfg.tensor_model_parallel_size=4",
        ],
        "policy.megatron_cfg.tensor_model_parallel_size",
        "key/value heads",
        id="megatron-tp-kv-heads",
    ),
    pytest.param(
        [
            *MEGATRON,
            "cluster.actor_gpus=3",
            "policy.megatron_cfg.pipeline_model_parallel_size=3",
            "critic.megatron_cfg.pipeline_model_parallel_size=3",
        ],
        "policy.megatron_cfg.pipeline_model_parallel_size",
        "layers",
        id="megatron-pp-layers",
    ),
    pytest.param(
        [
            *MEGATRON,
            "cluster.actor_gpus=2",
            "policy.megatron_cfg.tensor_model_parallel_size=2",
        ],
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
        ["policy.megatron_cfg.optimizer.overlap_param_gather=true"],
        "policy.megatron_cfg.optimizer.overlap_param_gather",
        "use_distributed_optimizer",
        id="overlap-param-gather-without-distopt",
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
        *MEGATRON,
        "policy.megatron_cfg.tensor_model_parallel_size=2",
        # minimum above the batch AND an unaligned batch (micro-batch 8: alignment 2)
        "ppo.num_prompts_per_step=15",
        "async_rl.min_groups_for_streaming_train=17",
        "policy.train_micro_batch_size=8",
    ]
    keys = {p.key for p in _errors(overrides)}
    expected = {o.partition("=")[0] for o in overrides} - {
        "policy.megatron_cfg.enabled",
        "critic.megatron_cfg.enabled",
        "policy.train_micro_batch_size",
    }
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


def test_existing_paths_are_accepted(tmp_path: Path, reward_module: str) -> None:
    model = _hf_dir(
        tmp_path / "m",
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=22,
        hidden_size=64,
    )
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


# --------------------------------------------------------------------------- Megatron


@needs_megatron
def test_megatron_enabled_with_defaults_is_valid() -> None:
    # validate builds the trainer's configs exactly as `train` does and runs the megatron
    # backend's own option parser on them: a driver -> trainer mapping bug is caught here.
    _, report = load_config(None, MEGATRON)
    assert report.ok, report.errors


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


@needs_megatron  # without megatron-core the missing extra is the one error reported
@pytest.mark.skipif(_te_available(), reason="Transformer Engine and CUDA are present here")
def test_fp8_params_need_transformer_engine() -> None:
    problems = [
        p
        for p in _errors([*MEGATRON, "policy.megatron_cfg.fp8_param=true"])
        if p.key == "policy.megatron_cfg.fp8_param"
    ]
    assert problems and "Transformer Engine" in str(problems[0])


def test_fp8_recipe_without_fp8_params_warns() -> None:
    _, report = load_config(None, ["policy.megatron_cfg.fp8_recipe=delayed"])
    assert report.ok
    assert [w.key for w in report.warnings] == ["policy.megatron_cfg.fp8_recipe"]


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
