"""Test helpers of ppo-trainer: tiny model spec, configs per backend, random PPO batches,
and the float tolerances the equivalence tests derive from what they compare.

(A uniquely named module, not ``conftest``: the packages' tests are collected together.)

Tolerances: the generic bounds (``rounding_bound``, ``model_terms``, ``norm_bound``,
``adam_step_bound``, ``head_magnitude``, ``assert_within``, ``EPS32`` / ``EPS64``) live in
the public ``ppo_trainer.testing`` (its docstring gives the derivations) so that other
packages' suites use the same ones; they are re-exported here. ``model_terms`` is
~600-1000 for these tests while the differences seen are 1-3 ``eps * magnitude``, so the
bounds do not depend on a CPU's summation order, and they are still 100x below what a
real defect moves (a wrong denominator or a dropped chunk changes gradients by >= 1e-2
relative).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ppo_trainer import ActorConfig, CriticConfig, ModelSpec
from ppo_trainer.testing import (
    EPS32,
    EPS64,
    adam_step_bound,
    assert_within,
    head_magnitude,
    model_terms,
    norm_bound,
    norm_of_bounds,
    rounding_bound,
)

__all__ = [
    "EPS32",
    "EPS64",
    "TINY",
    "PPOData",
    "actor_config",
    "adam_step_bound",
    "assert_within",
    "critic_config",
    "grad_bounds",
    "head_magnitude",
    "hf_named",
    "make_data",
    "model_terms",
    "norm_bound",
    "norm_of_bounds",
    "rounding_bound",
    "with_model_inputs",
]


def hf_named(worker: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors shaped like a worker's parameters (its ``grads()``) under the Hugging Face
    names of ``export_weights()`` (megatron keeps its own names and fused layouts)."""
    if worker.config.backend != "megatron":
        return dict(tensors)
    from ppo_trainer.megatron import _convert

    model = worker._policy if hasattr(worker, "_policy") else worker._critic
    return {k: v.clone() for k, v in _convert.megatron_to_hf(tensors, model.layout).items()}


def grad_bounds(
    magnitude: Mapping[str, torch.Tensor], *, terms: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Per element: ``rounding_bound`` with the tensor's largest accumulated magnitude
    (``magnitude[name]``: the elementwise sum of the absolute chunk contributions; the
    errors of a layer's products mix its elements, so the tensor's scale is the one that
    counts), and exactly 0 where nothing was accumulated (an embedding row of a token that
    never occurs is exactly 0 in every run)."""
    out = {}
    for name, m in magnitude.items():
        bound = rounding_bound(terms=terms, magnitude=float(m.abs().max()), dtype=dtype)
        out[name] = torch.where(m == 0, 0.0, bound).double()
    return out


TINY = ModelSpec(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    seed=1234,
)


def actor_config(backend: str, **overrides: Any) -> ActorConfig:
    kwargs: dict[str, Any] = {
        "model": TINY,
        "backend": backend,
        "device": "cpu",
        "lr": 1e-3,
        "micro_batch_size": 2,
        "max_grad_norm": 1.0,
    }
    kwargs.update(overrides)
    return ActorConfig(**kwargs)


def critic_config(backend: str, **overrides: Any) -> CriticConfig:
    kwargs: dict[str, Any] = {
        "model": TINY,
        "backend": backend,
        "device": "cpu",
        "lr": 1e-3,
        "micro_batch_size": 2,
        "max_grad_norm": 1.0,
        "value_clip": 0.2,
    }
    kwargs.update(overrides)
    return CriticConfig(**kwargs)


@dataclass
class PPOData:
    """A right-padded batch plus the per-token inputs of the losses (all ``[B, T]``)."""

    batch: dict[str, torch.Tensor]
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor

    def rows(self, index: list[int] | slice) -> PPOData:
        return PPOData(
            batch={k: v[index] for k, v in self.batch.items()},
            old_logprobs=self.old_logprobs[index],
            advantages=self.advantages[index],
            returns=self.returns[index],
            old_values=self.old_values[index],
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"batch.{k}": v for k, v in self.batch.items()}
        out.update(
            old_logprobs=self.old_logprobs,
            advantages=self.advantages,
            returns=self.returns,
            old_values=self.old_values,
        )
        return out

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor]) -> PPOData:
        return PPOData(
            batch={k.removeprefix("batch."): v for k, v in t.items() if k.startswith("batch.")},
            old_logprobs=t["old_logprobs"],
            advantages=t["advantages"],
            returns=t["returns"],
            old_values=t["old_values"],
        )


def make_data(b: int = 6, t: int = 14, *, seed: int = 0, vocab: int = 64) -> PPOData:
    """Random prompts + responses of different lengths, right padded with id 0.

    ``old_logprobs`` is a perturbation of zero-centred values (the tests replace it with
    the model's own log-probs plus noise), so ratios are away from 1 and clipping fires.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, t), generator=g)
    attention = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t)
    for i in range(b):
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        resp = int(torch.randint(1, t - prompt + 1, (1,), generator=g))
        attention[i, : prompt + resp] = 1
        loss_mask[i, prompt : prompt + resp] = 1.0
    ids = ids * attention
    return PPOData(
        batch={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask},
        old_logprobs=torch.zeros(b, t),
        advantages=torch.randn(b, t, generator=g) * loss_mask,
        returns=torch.randn(b, t, generator=g) * loss_mask,
        old_values=torch.zeros(b, t),
    )


def with_model_inputs(data: PPOData, logprobs: torch.Tensor, values: torch.Tensor) -> PPOData:
    """Old log-probs near the model's (noise 0.3: ratios clip), old values from the critic."""
    g = torch.Generator().manual_seed(99)
    mask = data.batch["loss_mask"]
    noise = torch.randn(logprobs.shape, generator=g) * 0.3
    return PPOData(
        batch=data.batch,
        old_logprobs=(logprobs + noise) * mask,
        advantages=data.advantages,
        returns=data.returns,
        old_values=values,
    )
