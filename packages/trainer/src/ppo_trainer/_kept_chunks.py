"""The chunks one actor rank keeps for the later policy epochs of a streamed step.

``train_chunk(keep=True)`` keeps each chunk's micro-batches on the CPU (with their
advantages, old log-probs and, with a KL loss, reference log-probs); ``train_epochs``
moves them back to the device for epochs 2..K and then drops them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["KeptChunks"]


class KeptChunks:
    """Kept micro-batches (CPU tensors) and their counts.

    ``counts``: ``tokens`` and ``samples`` (with at least one valid token) of the kept
    micro-batches, and ``rows`` of every kept chunk, including chunks without a valid
    token (whose micro-batches are not kept).
    """

    def __init__(self) -> None:
        self.micro_batches: list[dict[str, Tensor]] = []
        self.counts = {"tokens": 0.0, "samples": 0.0, "rows": 0.0}

    def add_rows(self, rows: float) -> None:
        """Count a kept chunk's rows (before anything of it runs)."""
        self.counts["rows"] += rows

    def add(self, mbs: Iterable[dict[str, Tensor]], *, tokens: float, samples: float) -> None:
        """Keep these micro-batches (minus the engine log-probs, which only the first
        epoch's metric reads), copied to the CPU."""
        for mb in mbs:
            mb.pop("engine_logprobs", None)
            self.micro_batches.append({k: v.to("cpu") for k, v in mb.items()})
        self.counts["tokens"] += tokens
        self.counts["samples"] += samples

    def on_device(self, device: torch.device) -> list[dict[str, Tensor]]:
        """The kept micro-batches, copied to ``device`` (the kept ones stay on the CPU)."""
        return [{k: v.to(device) for k, v in mb.items()} for mb in self.micro_batches]
