"""Typed batches: one chunk of a step (:class:`ChunkBatch`) and the whole step (:class:`StepBatch`).

Shapes: ``B`` rows (samples; whole groups, group by group), ``T`` columns (prompt +
response tokens, right padded). The replay buffer fills the rollout fields; the pump
fills the training fields in stages (values, then advantages and returns); reading a
training field before its stage raises, naming the stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ChunkBatch", "StepBatch"]


@dataclass
class ChunkBatch:
    """The samples of the groups one sampler selection released.

    From the rollout (``ppo_driver.rollout.build_batch``):

    - ``input_ids`` ``[B, T]`` long: prompt then response, right padded with the pad id;
    - ``attention_mask`` ``[B, T]`` long: 1 on prompt and response tokens;
    - ``loss_mask`` ``[B, T]`` float: 1 on response tokens;
    - ``rewards`` ``[B, T]`` float: the sample's reward at its last response token;
    - ``engine_logprobs`` ``[B, T]`` float: the engine's log-prob of each response token
      (shifted convention, 0 elsewhere);
    - ``sample_rewards`` ``[B]`` float, ``weight_versions`` ``[B]`` long (the policy
      version that generated the sample), ``prompt_indices`` ``[B]`` long (= group id).

    Filled by the pump:

    - ``old_values`` ``[B, T]`` float: the unchanged critic's values (value forward);
    - ``advantages``, ``returns`` ``[B, T]`` float: GAE per sample (advantages
      whitened per chunk when configured); frozen for every critic epoch.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    rewards: Tensor
    engine_logprobs: Tensor
    sample_rewards: Tensor
    weight_versions: Tensor
    prompt_indices: Tensor
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None

    @classmethod
    def from_rollout(cls, rows: Mapping[str, Tensor]) -> ChunkBatch:
        """From the replay buffer's batch (a mapping with exactly the rollout fields)."""
        names = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in names if n not in rows]
        if missing:
            raise ValueError(f"ChunkBatch.from_rollout: missing {missing} (have {sorted(rows)})")
        return cls(**{n: rows[n] for n in names})

    @property
    def size(self) -> int:
        """``B``: the number of samples."""
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        """``T``: the padded sequence length."""
        return int(self.input_ids.shape[1])

    def model_inputs(self) -> dict[str, Tensor]:
        """What the trainer workers read: ``input_ids``, ``attention_mask``, ``loss_mask``."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "loss_mask": self.loss_mask,
        }

    def need(self, name: str) -> Tensor:
        """A training field that must be filled by now."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"{type(self).__name__}.{name} is not filled yet: the pump fills old_values "
                "at the value forward, advantages and returns at GAE"
            )
        assert isinstance(value, Tensor)
        return value


@dataclass
class StepBatch(ChunkBatch):
    """The whole step: its chunks' rows concatenated, right padded to the widest chunk
    (``T = max T_k``) and sorted by prompt index, so that the batch does not depend on
    the chunk boundaries (full-batch and streaming train the critic on the same rows).
    Every field is filled. ``chunk_sizes``: groups per chunk, in arrival order."""

    chunk_sizes: tuple[int, ...] = ()

    @classmethod
    def assemble(
        cls, chunks: Sequence[ChunkBatch], *, pad_id: int, group_sizes: Sequence[int]
    ) -> StepBatch:
        if not chunks:
            raise ValueError("StepBatch.assemble: no chunks")
        width = max(c.width for c in chunks)
        fields: dict[str, Tensor] = {}
        for f in dataclasses.fields(ChunkBatch):
            parts = [c.need(f.name) if f.default is None else getattr(c, f.name) for c in chunks]
            fill = float(pad_id) if f.name == "input_ids" else 0.0
            fields[f.name] = torch.cat([_pad_to(p, width, fill) for p in parts], dim=0)
        order = torch.argsort(fields["prompt_indices"], stable=True)
        return cls(
            **{k: v[order] for k, v in fields.items()},
            chunk_sizes=tuple(int(g) for g in group_sizes),
        )

    def valid_tokens(self) -> float:
        return float(self.loss_mask.sum().item())


def _pad_to(t: Tensor, width: int, value: float) -> Tensor:
    if t.dim() < 2 or t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)
