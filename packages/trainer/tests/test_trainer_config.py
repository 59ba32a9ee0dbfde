"""Config validation (ValueError naming key, value and fix), lr schedule, no-pickle state files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_trainer import ActorConfig, CriticConfig, ModelSpec, get_backend, lr_multiplier
from ppo_trainer._serialize import flatten_state, load_state, save_state, unflatten_state
from trainer_testlib import EPS64


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        pytest.param(ActorConfig, {"eps_clip": 1.5}, r"actor\.eps_clip=1\.5", id="eps_clip"),
        pytest.param(ActorConfig, {"dual_clip": 0.5}, r"actor\.dual_clip=0\.5.*> 1", id="dual"),
        pytest.param(ActorConfig, {"kl_estimator": "k4"}, r"actor\.kl_estimator='k4'", id="kl"),
        pytest.param(ActorConfig, {"loss_agg": "mean"}, r"actor\.loss_agg='mean'", id="agg"),
        pytest.param(ActorConfig, {"lr": 0.0}, r"actor\.lr=0\.0", id="lr"),
        pytest.param(
            ActorConfig, {"lr_scheduler": "cosine"}, r"actor\.decay_steps=None", id="decay"
        ),
        pytest.param(CriticConfig, {"value_clip": -1.0}, r"critic\.value_clip=-1\.0", id="vclip"),
        pytest.param(
            CriticConfig, {"micro_batch_size": 0}, r"critic\.micro_batch_size=0", id="mbs"
        ),
        pytest.param(
            CriticConfig, {"offload_backend": "disk"}, r"critic\.offload_backend='disk'", id="off"
        ),
    ],
)
def test_config_errors_name_key_and_value(cls: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_model_spec_validation() -> None:
    with pytest.raises(ValueError, match=r"model\.hidden_size=65"):
        ModelSpec(hidden_size=65)
    with pytest.raises(ValueError, match=r"model\.num_key_value_heads=3"):
        ModelSpec(num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"model\.dtype='int8'"):
        ModelSpec(dtype="int8")


def test_unknown_backend_and_options() -> None:
    with pytest.raises(ValueError, match="backend='jax' is unknown"):
        get_backend("jax")
    from ppo_trainer import ActorWorker

    with pytest.raises(ValueError, match="backend_options"):
        ActorWorker(ActorConfig(backend_options={"tensor_model_parallel_size": 2}, device="cpu"))


@pytest.mark.parametrize(
    ("scheduler", "steps", "expected"),
    [
        pytest.param("constant", [0, 1, 2, 10], [1 / 3, 2 / 3, 1.0, 1.0], id="constant"),
        pytest.param("linear", [2, 3, 4, 6, 9], [1.0, 0.775, 0.55, 0.1, 0.1], id="linear"),
        pytest.param("cosine", [2, 4, 6], [1.0, 0.55, 0.1], id="cosine"),
    ],
)
def test_lr_multiplier(scheduler: str, steps: list[int], expected: list[float]) -> None:
    got = [
        lr_multiplier(step=s, scheduler=scheduler, warmup_steps=2, decay_steps=4, min_lr_ratio=0.1)
        for s in steps
    ]
    # float64, values <= 1, at most six rounded operations (one libm cos, within 1 ulp)
    # against decimal literals (each within half an ulp): 8 eps64 absolute.
    assert got == pytest.approx(expected, rel=0, abs=8 * EPS64)


def test_state_round_trip_without_pickle(tmp_path: Path) -> None:
    exp_avg = torch.randn(2, 3)
    state: dict[str, Any] = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "dtype": torch.bfloat16,
        "__tensor__": "a key that looks like a tag",
        "none": None,
    }
    skeleton, tensors = flatten_state(state)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    back = unflatten_state(skeleton, tensors)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["dtype"] is torch.bfloat16 and back["__tensor__"] == state["__tensor__"]
    torch.testing.assert_close(  # a round trip moves bytes: bit for bit
        back["optimizer"]["state"][0]["exp_avg"], exp_avg, rtol=0, atol=0
    )
    save_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.safetensors"]
    loaded = load_state(tmp_path)
    assert 0 in loaded["optimizer"]["state"]
    with pytest.raises(TypeError, match="cannot be saved without pickle"):
        flatten_state({"bad": object()})


def test_problems_are_data_all_at_once_without_building() -> None:
    from ppo_trainer import TrainerConfigError

    actor = ActorConfig.problems(lr=0.0, eps_clip=1.5, dual_clip=0.5, kl_estimator="k4")
    assert [(p.field, p.value) for p in actor] == [
        ("lr", 0.0),
        ("eps_clip", 1.5),
        ("dual_clip", 0.5),
        ("kl_estimator", "k4"),
    ]
    assert all(p.section == "actor" and p.message and p.fix for p in actor)
    with pytest.raises(TrainerConfigError) as info:
        ActorConfig(lr=0.0, eps_clip=1.5, dual_clip=0.5, kl_estimator="k4")
    assert info.value.problems == actor
    assert [p.field for p in CriticConfig.problems(value_clip=-1.0, micro_batch_size=0)] == [
        "micro_batch_size",
        "value_clip",
    ]
    spec = ModelSpec.problems(hidden_size=66, num_key_value_heads=3, dtype="int8")
    assert [p.field for p in spec] == ["hidden_size", "num_key_value_heads", "dtype"]
    assert ModelSpec.problems() == [] and ActorConfig.problems() == []
    with pytest.raises(TypeError, match="no field 'lrr'"):
        ActorConfig.problems(lrr=1.0)


def test_megatron_rules_need_no_megatron_and_report_everything() -> None:
    import subprocess
    import sys

    # importable without megatron-core: the driver's validate asks them on any machine
    code = (
        "import sys; from ppo_trainer import option_problems, mesh_problems; "
        "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    from ppo_trainer import MegatronConfigError, data_parallel_size, mesh_problems, option_problems

    options = {
        "use_megatron_fsdp": True,
        "tensor_model_parallel_size": 0,
        "transformer_impl": "te",
        "fp8_recipe": "custom",
        "optimizer": {"overlap_param_gather": True, "bogus": 1},
    }
    fields = [p.field for p in option_problems(options, prefix="policy.megatron_cfg")]
    assert fields == [
        "optimizer.bogus",
        "use_megatron_fsdp",
        "optimizer.overlap_param_gather",
        "tensor_model_parallel_size",
        "transformer_impl",
        "fp8_recipe",
    ]
    warn = option_problems({"fp8_recipe": "delayed"})
    assert [(p.field, p.severity) for p in warn] == [("fp8_recipe", "warning")]
    fp8 = option_problems({"fp8_param": True, "transformer_impl": "local"}, te_available=True)
    assert [p.field for p in fp8] == ["fp8_param", "fp8_param"]
    assert "transformer_impl=local" in fp8[0].message  # the specific problem first
    assert "not supported by the Megatron backend yet" in fp8[1].message
    mesh = mesh_problems(world_size=4, tp=4, pp=3, heads=4, kv_heads=2, vocab=20, layers=2)
    assert [p.field for p in mesh] == [
        "tensor_model_parallel_size",  # 4 x 3 does not divide 4
        "tensor_model_parallel_size",  # 4 does not divide 2 kv heads
        "pipeline_model_parallel_size",  # 3 does not divide 2 layers
    ]
    assert "their greatest is 2" in mesh[1].fix
    assert data_parallel_size(world_size=8, tp=2, pp=2) == 2
    with pytest.raises(MegatronConfigError, match="does not divide world_size=6"):
        data_parallel_size(world_size=6, tp=4, pp=1)
