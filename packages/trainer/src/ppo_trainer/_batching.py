"""What both workers do to a batch before a backend sees it: shape checks, the step's loss
denominator, micro-batching, and the shifted layout of docs/interfaces.md.

Tensors in and out are ``[B, T]`` (``[b, T]`` per micro-batch); the shifted layout puts
the quantity about token ``t`` at column ``t`` (column 0 = 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ppo_trainer._backend import Batch
from ppo_trainer._math import logprobs_from_logits

__all__ = [
    "check_batch",
    "cpu_cat",
    "logprobs_fn",
    "loss_denominator",
    "micro_batches",
    "rows",
    "shift",
    "valid_counts",
    "values_fn",
]


def loss_denominator(*, loss_mask: Tensor, loss_agg: str) -> float:
    """The denominator the driver passes to every ``train_chunk`` of one step.

    ``loss_mask: [B, T]``: the WHOLE step's loss mask over all chunks and ranks (or sum
    the per-chunk results). ``token``: the number of valid tokens; ``sample``: the
    number of samples with at least one valid token.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must have shape [B, T], got {tuple(loss_mask.shape)}")
    if loss_agg == "token":
        return float(loss_mask.sum().item())
    if loss_agg == "sample":
        return float((loss_mask.sum(dim=1) > 0).sum().item())
    raise ValueError(f"loss_agg={loss_agg!r} is unknown: use 'token' or 'sample'")


def check_batch(batch: Mapping[str, Tensor], keys: Sequence[str], **extra: Tensor | None) -> int:
    """Shape checks; returns B."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; it needs {list(keys)} (docs/interfaces.md)")
    shape = batch["input_ids"].shape
    if len(shape) != 2:
        raise ValueError(f"batch['input_ids'] must have shape [B, T], got {tuple(shape)}")
    for k in keys:
        if batch[k].shape != shape:
            raise ValueError(
                f"batch[{k!r}] has shape {tuple(batch[k].shape)}, input_ids has {tuple(shape)}"
            )
    for name, t in extra.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, input_ids has {tuple(shape)}")
    return int(shape[0])


def valid_counts(mask: Tensor) -> tuple[float, float]:
    """``(valid tokens, samples with at least one valid token)`` of a ``[B, T]`` mask."""
    return float(mask.sum().item()), float((mask.sum(dim=1) > 0).sum().item())


def micro_batches(
    tensors: Mapping[str, Tensor], *, size: int, device: torch.device
) -> list[dict[str, Tensor]]:
    """Rows ``[start, start + size)`` of every tensor, moved to ``device``, each cut to
    its own width: the columns after the last one any of its rows attends to
    (``attention_mask``) are dropped.

    Those columns cannot change an earlier position under a causal mask, so the result is
    the same math; what the trim buys is that a micro-batch is computed alike whatever
    batch it was cut from. Its width is then a function of its own rows, never of the
    widest row of the chunk (a streamed chunk, or the whole step) around it, and neither
    are its gradients bit for bit (the weight-gradient GEMMs reduce over every position,
    padded ones included, in blocks that follow the width). Outputs are padded back with
    :func:`cpu_cat`.
    """
    n = int(next(iter(tensors.values())).shape[0])
    out = []
    for start in range(0, n, size):
        rows_ = {k: v[start : start + size] for k, v in tensors.items()}
        width = _attended_width(rows_.get("attention_mask"))
        out.append(
            {k: v[:, :width].to(device) if width else v.to(device) for k, v in rows_.items()}
        )
    return out


def _attended_width(attention_mask: Tensor | None) -> int | None:
    """One past the last column any row attends to (at least 1); None: keep the width."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return None
    attended = attention_mask.bool().any(dim=0).nonzero()
    width = int(attended.max().item()) + 1 if attended.numel() else 1
    return None if width == attention_mask.shape[1] else width


def shift(native: Tensor) -> Tensor:
    """Native ``[b, T]`` (position t about token t+1) -> shifted ``[b, T]``, column 0 = 0."""
    return torch.cat([native.new_zeros(native.shape[0], 1), native[:, :-1]], dim=1)


def logprobs_fn(logits: Tensor, mb: Batch) -> Tensor:
    """Shifted log-probs ``[b, T]`` from native logits ``[b, T, V]``."""
    ids = mb["input_ids"]
    lp = logprobs_from_logits(logits=logits[:, :-1], labels=ids[:, 1:])
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def values_fn(values: Tensor, mb: Batch) -> Tensor:
    """Shifted values ``[b, T]`` from the value head's native ``[b, T]``."""
    return shift(values)


def cpu_cat(parts: list[Tensor], *, attention_mask: Tensor) -> Tensor:
    """The micro-batches' outputs as one ``[B, T]`` tensor on the CPU, ``attention_mask``
    the batch's (``[B, T]``): each part is padded back from its own (trimmed,
    :func:`micro_batches`) width, and every position no token is at (mask 0) is 0, so
    the result does not depend on how the batch was cut either."""
    width = int(attention_mask.shape[1])
    out = torch.cat([F.pad(p.to("cpu"), (0, width - p.shape[1])) for p in parts], dim=0)
    return torch.where(attention_mask.bool(), out, torch.zeros_like(out))


def rows(mbs: Sequence[Batch]) -> int:
    """Samples (rows) over the micro-batches."""
    return sum(int(mb["input_ids"].shape[0]) for mb in mbs)
