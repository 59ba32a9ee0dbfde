"""Scale presets for the step simulator. SIMULATION INPUTS, NOT MEASUREMENTS.

No number here was measured by this project (its machine has no GPU). Each is derived
from a published hardware figure or a stated assumption, so that a reader can check
it and replace it with a measurement (``ppo-driver simulate --from`` fits real ones).

Sources and assumptions (used by every preset):

* Training compute: NVIDIA H100 SXM, 989 TFLOP/s dense BF16 (NVIDIA H100 Tensor Core
  GPU datasheet), at 40 % model FLOPs utilisation. Megatron-LM reports roughly 41-47 % MFU for
  GPT models of 5B-462B parameters on H100 clusters (its README's weak-scaling table);
  40 % is a round, slightly conservative assumption. FLOPs per token: 2N forward, 6N
  forward + backward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models").
  (The MFU range is as we recall the Megatron-LM README; check it before relying on it.)
* Tokens per sample: a 512-token prompt plus the mean response of the length model
  (lognormal, median 2,500 tokens, sigma 0.6, capped at 32,768: mean ~3,000): ~3,500.
  The costs scale with tokens (``scaling="packed"``: padding-free passes, a 512-token
  prompt per sample): a chunk of short responses costs less than one of long ones, so
  the tail's chunk, which holds the longest responses, costs more than its share.
  The shape is an assumption: reasoning RL reports mean lengths growing to several
  thousand tokens with a tail to the cap (DAPO, arXiv:2503.14476, max 20,480 tokens;
  the long tail is why AReaL, arXiv:2505.24298, and Kimi k1.5, arXiv:2501.12599,
  rework rollout). With this model 99 % of responses end below ~10,000 tokens, a third
  of the cap.
* Generation: decoding is memory-bound; a decode step reads the weights and the KV
  cache of every sequence in flight. H100 HBM3 bandwidth 3.35 TB/s (datasheet).
  7B-class (Llama-3-8B shape: 32 layers, 8 KV heads of 128, BF16: 128 KiB of KV per
  token) on one 80 GB GPU: the KV cache of 128 sequences of ~3,000 tokens (~50 GB)
  fits beside the ~16 GB of weights, 256 would not; a step reads ~65 GB -> ~19 ms at
  the roofline; assumed 5,400 tokens/s per engine at 128 sequences (~42 tokens/s per
  sequence, ~80 % of the roofline). 70B-class (80 layers, 8 KV heads: 320 KiB per
  token) on an 8-GPU tensor-parallel engine (640 GB): 256 sequences' KV (~250 GB) fits
  beside 140 GB of weights; ~48 GB per GPU per step -> ~15 ms; assumed 8,000 tokens/s
  per engine at 256 sequences (~31 tokens/s per sequence, ~45 % of the roofline: TP
  all-reduces, scheduling).
  Published offline benchmarks of vLLM and SGLang report the same order (thousands of
  output tokens/s per GPU); the exact value depends on the engine, the version and the
  lengths, so treat these within about 2x.
* Optimizer step, refit, switch: assumptions of order of magnitude, not sourced
  measurements. Refit: the policy's BF16 weights (14 GB / 140 GB) broadcast to the
  engines, 5 s / 20 s. A model switch (one model's parameters and optimizer state
  offloaded, the other's loaded, over PCIe Gen5 at ~25 GB/s effective per GPU):
  ~25 GB per GPU for 7B on 8 GPUs (DP 8), ~30 GB per GPU for 70B on 64 GPUs
  (TP 8): 2 s and 3 s. Optimizer step 1 s / 2 s. Per chunk 0.5 s (Ray round trips,
  GAE), per step 2 s (batch assembly, bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_sampler._simulate import (
    GenerationModel,
    LognormalLengths,
    TrainingCosts,
    Workload,
)

__all__ = ["PRESETS", "Preset"]

_H100_BF16_FLOPS = 989e12
_MFU = 0.40
_PROMPT_TOKENS = 512
_TOKENS_PER_SAMPLE = _PROMPT_TOKENS + 3_000
_REASONING = LognormalLengths(median=2_500, sigma=0.6, max_tokens=32_768)


def _per_sample(params: float, gpus: int, flops_per_param_token: int) -> float:
    """Seconds per sample of a pass over ``params`` parameters on ``gpus`` H100s."""
    return flops_per_param_token * params * _TOKENS_PER_SAMPLE / (gpus * _H100_BF16_FLOPS * _MFU)


def _costs(
    params: float, gpus: int, *, optimizer_s: float, refit_s: float, switch_s: float
) -> TrainingCosts:
    forward, train = _per_sample(params, gpus, 2), _per_sample(params, gpus, 6)
    return TrainingCosts(
        value_forward_per_sample=forward,
        actor_train_per_sample=train,
        actor_forward_per_sample=forward,
        critic_train_per_sample=train,
        critic_epochs=2,
        policy_epochs=1,
        optimizer_s=optimizer_s,
        refit_s=refit_s,
        switch_s=switch_s,
        chunk_overhead_s=0.5,
        step_overhead_s=2.0,
        scaling="packed",
        reference_tokens=_TOKENS_PER_SAMPLE,
        prompt_tokens=_PROMPT_TOKENS,
    )


@dataclass(frozen=True)
class Preset:
    description: str
    workload: Workload
    generation: GenerationModel
    costs: TrainingCosts
    lengths: LognormalLengths


_WORKLOAD = Workload(batch=256, min_groups=32, samples_per_group=8, lookahead=0)
"""The document's configuration (256 prompts, minimum 32), 8 samples per prompt."""

PRESETS: dict[str, Preset] = {
    "7b-8gpu": Preset(
        description="SIMULATION: 7B policy + 7B critic sharing 8 H100s; generation on 8 "
        "more H100s (8 engines); long-tail reasoning lengths (median 2,500, cap 32,768)",
        workload=_WORKLOAD,
        generation=GenerationModel(tokens_per_s=5_400.0, concurrency=128, engines=8),
        costs=_costs(7e9, 8, optimizer_s=1.0, refit_s=5.0, switch_s=2.0),
        lengths=_REASONING,
    ),
    "70b-64gpu": Preset(
        description="SIMULATION: 70B policy + 70B critic sharing 64 H100s; generation on "
        "64 more H100s (8 engines of TP 8); long-tail reasoning lengths",
        workload=_WORKLOAD,
        generation=GenerationModel(tokens_per_s=8_000.0, concurrency=256, engines=8),
        costs=_costs(70e9, 64, optimizer_s=2.0, refit_s=20.0, switch_s=3.0),
        lengths=_REASONING,
    ),
}
"""Scale presets (``python -m ppo_sampler simulate --preset NAME``); projections only."""
