"""The sglang engine: output parsing runs everywhere; the engine itself and the NCCL
refit need CUDA and the ``sglang`` extra (``gpu`` marker, skipped here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from ppo_driver.rollout import parse_sglang_output

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="needs the sglang extra"
)


def test_parse_sglang_output_stop_and_length() -> None:
    stop = {
        "output_ids": [5, 6, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [(-0.5, 5, None), (-0.25, 6, None), (-0.125, 2, None)],
        },
    }
    s = parse_sglang_output(stop)
    assert s.token_ids == (5, 6, 2) and s.logprobs == (-0.5, -0.25, -0.125)
    assert s.finish_reason == "stop"
    length = {
        "output_ids": [7],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "output_token_logprobs": [(-1.0, 7, None)],
        },
    }
    assert parse_sglang_output(length).finish_reason == "length"
    # a stop token that sglang left out of the output is appended
    cut = {
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [(-0.5, 5, None)],
        }
    }
    assert parse_sglang_output(cut).token_ids == (5, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_sglang
def test_sglang_engine_generates_refits_and_sleeps(tmp_path: Path) -> None:
    from ppo_driver.rollout import CharTokenizer, GroupRequest, SamplingParams, SglangEngine
    from ppo_trainer import ModelSpec, build_causal_lm, save_hf_checkpoint

    tok = CharTokenizer()
    spec = ModelSpec(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2)
    weights = build_causal_lm(spec).state_dict()
    save_hf_checkpoint(weights=weights, spec=spec, path=tmp_path / "m")
    engine = SglangEngine(
        model_path=str(tmp_path / "m"),
        run_seed=0,
        skip_tokenizer_init=True,
        mem_fraction_static=0.2,
    )
    try:
        params = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=(tok.eos_id,))
        req = GroupRequest(prompt_index=0, prompt_ids=tuple(tok.encode("a3:")), params=params)
        (out,) = engine.generate([req])
        assert len(out.samples) == 2 and out.weight_version == 0
        assert all(len(s.token_ids) == len(s.logprobs) >= 1 for s in out.samples)
        engine.release_memory()
        engine.resume_memory()
        new = {k: (v + 0.01).cuda() for k, v in weights.items()}
        assert engine._apply(1, new) == 1
        (out1,) = engine.generate([req])
        assert out1.weight_version == 1
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_refit_into_embedded_engine_on_gpu() -> None:
    import ray
    from ppo_driver.rollout import WeightRefitter, launch_embedded_engines, tiny_qwen2_config
    from ppo_placement import shutdown_local_ray, start_local_ray

    start_local_ray(num_gpus=1, num_cpus=4)
    try:

        @ray.remote(num_gpus=0.5)
        class Holder:
            def __init__(self) -> None:
                from ppo_driver.rollout import build_model

                self.model = build_model(tiny_qwen2_config(), seed=1, device="cuda")

            def export_weights(self) -> dict[str, torch.Tensor]:
                return {k: v.detach() for k, v in self.model.state_dict().items()}

        holder = Holder.remote()  # type: ignore[attr-defined]
        (engine,) = launch_embedded_engines(
            1, model=tiny_qwen2_config(), run_seed=0, num_gpus=0.5, device="cuda"
        )
        stats = WeightRefitter(actor=holder, engines=[engine], backend="nccl").refit(version=1)
        assert stats.transport == "nccl" and ray.get(engine.health.remote()).weight_version == 1
    finally:
        shutdown_local_ray()
