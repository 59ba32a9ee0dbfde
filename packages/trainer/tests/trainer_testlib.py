"""Test helpers of ppo-trainer: tiny model spec, configs per backend, random PPO batches.

(A uniquely named module, not ``conftest``: the packages' tests are collected together.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from ppo_trainer import ActorConfig, CriticConfig, ModelSpec

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
