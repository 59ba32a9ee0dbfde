"""Megatron through the driver's worker groups with two ranks per model: data parallel 2,
tensor parallel 2 and pipeline parallel 2 (gloo on CPU), each against one rank.

What the driver must get right, and how each is observed here:

* rows: tensor and pipeline peers get the SAME rows, only data-parallel ranks split
  (a tensor-parallel pair fed different rows computes its forward on a mix of two
  samples). The trainer's log-prob of every sampled token must equal the engine's,
  which generated it with the same weights: ``rollout/kl_engine_trainer`` (k3, second
  order in the per-token difference) stays at float32 rounding, ~1e-12; wrong rows give
  differences of order one per token.
* refit: the HF export is a collective over the tensor/pipeline ranks; every rank joins
  it and rank 0 sends. After step 0's refit the engine holds the trained weights, and
  step 1's log-probs agree the same way (a missed or garbled refit gives ~1e-3 or more).
* the step's gradient: the same samples give the same gradient in every layout, up to
  float32 rounding of another reduction order. The gradient norm of step 0 is compared
  with the one-rank run within ``norm_bound``-style rounding: ``2 n eps32`` relative,
  ``n`` the longest chain of accumulated terms (``ppo_trainer.testing.model_terms``).

Parameter-by-parameter equality of each layout with one process (gradients reassembled
from the shards, weights after the Adam step within derived bounds) is the trainer's
``test_megatron_parallel.py``, on rows fed the way these groups now feed them.

Minutes on a busy 2-core machine (each run starts four Megatron worker processes), so
``slow``; needs the ``ppo-trainer[megatron]`` extra (the ``slow`` session has it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from driver_testlib import TINY_RUN
from ppo_driver.config import load_config
from ppo_driver.run import train
from ppo_trainer import ModelSpec
from ppo_trainer.testing import EPS32, model_terms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

LAYOUTS = {
    "one": ["cluster.actor_gpus=1"],
    "dp2": ["cluster.actor_gpus=2"],
    "tp2": [
        "cluster.actor_gpus=2",
        *(f"{r}.megatron_cfg.tensor_model_parallel_size=2" for r in ("policy", "critic")),
    ],
    "pp2": [
        "cluster.actor_gpus=2",
        *(f"{r}.megatron_cfg.pipeline_model_parallel_size=2" for r in ("policy", "critic")),
    ],
}
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    pytest.importorskip("megatron.core")
    from ppo_placement import shutdown_local_ray, start_local_ray

    start_local_ray(num_gpus=3, num_cpus=8)
    yield
    shutdown_local_ray()


def _run(tmp: Path, name: str, *extra: str) -> list[dict[str, object]]:
    cfg, _ = load_config(
        None,
        [
            *TINY_RUN,
            f"run.num_steps={STEPS}",
            "run.progress=false",
            *(f"{r}.megatron_cfg.enabled=true" for r in ("policy", "critic")),
            *(
                f"{r}.{k}=2"  # two pipeline stages; heads that split over two tensor ranks
                for r in ("policy", "critic")
                for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
            ),
            *extra,
        ],
    )
    result = train(cfg, run_dir=tmp / name, keep_ray=True)
    return result.metrics


def test_dp_tp_pp_feed_the_right_rows_refit_over_the_group_and_match_one_rank(
    tmp_path: Path,
) -> None:
    runs = {name: _run(tmp_path, name, *extra) for name, extra in LAYOUTS.items()}
    for name, rows in runs.items():
        assert [r["step"] for r in rows] == list(range(STEPS)), name
        for row in rows:
            assert abs(float(row["rollout/kl_engine_trainer"])) < 1e-9, (name, row)
            assert row["train/actor_forwards_per_sample"] == 1.0, (name, row)

    # step 0 trains on the same samples in every layout (same seed, same initial
    # weights, generation starts after the previous refit): the same gradient
    spec = ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64)
    seq = spec.max_position_embeddings  # an upper bound on the positions
    relative = 2 * model_terms(spec, tokens=16 * seq, seq_len=seq) * EPS32
    ref = runs["one"][0]
    for name in ("dp2", "tp2", "pp2"):
        got = runs[name][0]
        assert got["rollout/reward_mean"] == ref["rollout/reward_mean"], name  # same samples
        norm, ref_norm = float(got["actor/grad_norm"]), float(ref["actor/grad_norm"])
        print(f"{name}: |grad norm - one rank's| / bound = "
              f"{abs(norm - ref_norm) / (relative * ref_norm):.3g}")  # fmt: skip
        assert abs(norm - ref_norm) <= relative * ref_norm, (name, norm, ref_norm, relative)
