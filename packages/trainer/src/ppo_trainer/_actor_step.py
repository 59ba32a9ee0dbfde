"""One policy step's bookkeeping on one actor rank: the loss denominator its chunks pass,
the sums its chunks add up, the final denominator's check at ``finish_step``, and the
metrics of a chunk and of an update (pure: no model, no device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from ppo_trainer._config import ActorConfig
from ppo_trainer._worker_base import EmptyStepError

__all__ = [
    "StepSums",
    "check_final_denominator",
    "chunk_metrics",
    "final_denominator",
    "update_metrics",
]

#: What a step sums on each rank (and all-reduces at finish_step), in this order.
_SUM_KEYS = ("tokens", "samples", "rows", "pg", "kl", "entropy", "clipfrac", "approx_kl")
#: The per-micro-batch loss sums (``actor_loss``) among them.
_LOSS_KEYS = ("pg", "kl", "entropy", "clipfrac", "approx_kl")


class StepSums:
    """The open step: ``denominator`` (the count every chunk passed; ``None`` before the
    first chunk), ``chunks`` (``train_chunk`` calls so far) and ``sums`` (tokens, samples,
    rows and the loss sums over the step's micro-batches)."""

    def __init__(self) -> None:
        self.denominator: float | None = None
        self.chunks = 0
        self.sums: dict[str, float] = dict.fromkeys(_SUM_KEYS, 0.0)

    def use_denominator(self, loss_denominator: float, *, loss_agg: str) -> None:
        """Check a chunk's ``loss_denominator``: positive, and the one of every chunk."""
        if not (isinstance(loss_denominator, int | float) and loss_denominator > 0):
            raise ValueError(
                f"loss_denominator={loss_denominator!r} is invalid: pass the whole step's "
                f"positive {'valid-token' if loss_agg == 'token' else 'sample'} count"
            )
        if self.denominator is None:
            self.denominator = float(loss_denominator)
        elif not math.isclose(self.denominator, float(loss_denominator)):
            raise ValueError(
                f"loss_denominator={loss_denominator!r} differs from {self.denominator!r} given "
                "earlier in this step: every chunk of a step must pass the same (whole-step) count"
            )

    def add(
        self, results: Sequence[Mapping[str, float]], *, tokens: float, samples: float
    ) -> dict[str, float]:
        """One pass's micro-batch results, summed, added to the step's sums."""
        summed = {k: sum(r[k] for r in results) for k in results[0]}
        self.sums["tokens"] += tokens
        self.sums["samples"] += samples
        for k in _LOSS_KEYS:
            self.sums[k] += summed[k]
        return summed

    def totals(self, all_reduce_sum: Callable[[Sequence[float]], list[float]]) -> dict[str, float]:
        """The sums over every data-parallel rank (a collective: every rank calls it)."""
        reduced = all_reduce_sum([self.sums[k] for k in _SUM_KEYS])
        return dict(zip(_SUM_KEYS, reduced, strict=True))


def check_final_denominator(loss_denominator: float | None) -> None:
    """``finish_step``'s ``loss_denominator``: ``None`` or a positive count."""
    if loss_denominator is not None and not (
        isinstance(loss_denominator, int | float) and loss_denominator > 0
    ):
        raise ValueError(
            f"loss_denominator={loss_denominator!r} is invalid: pass the whole step's "
            "positive count, or None to keep the one given to train_chunk()"
        )


def final_denominator(
    totals: Mapping[str, float],
    *,
    provisional: float | None,
    given: float | None,
    loss_agg: str,
) -> float:
    """The step's final denominator (``given``, else the chunks' ``provisional`` one),
    checked against the step's count over all chunks and ranks (``totals``).

    Raises ``EmptyStepError`` when the step had no valid token and ``ValueError`` when the
    denominator is not the step's count; the caller discards the gradients.
    """
    if totals["tokens"] == 0:
        raise EmptyStepError(
            "finish_step(): every sample of this step is masked (0 valid tokens over all "
            "ranks); no update was made. The driver must not train on an all-masked step."
        )
    assert provisional is not None  # tokens > 0 implies a train_chunk call
    final = provisional if given is None else float(given)
    if loss_agg == "token":
        allowed, what = [totals["tokens"]], "valid-token count"
    else:
        allowed, what = [totals["samples"], totals["rows"]], "sample count"
    if not any(math.isclose(final, a, rel_tol=1e-9) for a in allowed):
        raise ValueError(
            f"loss_denominator={final!r} does not match the step's {what} "
            f"{' or '.join(repr(a) for a in allowed)} over all chunks and ranks; no update "
            "was made. Pass loss_denominator(loss_mask=<whole step>, loss_agg=...)"
        )
    return final


def chunk_metrics(
    *, tokens: float, summed: Mapping[str, float] | None, config: ActorConfig, engine: bool
) -> dict[str, float]:
    """``train_chunk``'s metrics from the chunk's summed micro-batch results (``None``:
    the chunk had no valid token, nothing ran: zeros). ``engine``: engine log-probs came."""
    if summed is None:
        summed = dict.fromkeys(("pg", "kl", "entropy", "kl_engine"), 0.0)
        clipfrac = approx_kl = 0.0
    else:
        clipfrac, approx_kl = summed["clipfrac"] / tokens, summed["approx_kl"] / tokens
    metrics = {
        "actor/valid_tokens": tokens,
        "loss/pg": summed["pg"],
        "actor/clipfrac": clipfrac,
        "actor/approx_kl": approx_kl,
    }
    if config.use_reference:
        metrics["loss/kl"] = summed["kl"]
    if config.entropy_coef > 0:
        metrics["loss/entropy"] = summed["entropy"]
    if engine:
        metrics["rollout/kl_engine_trainer_sum"] = summed["kl_engine"]
    return metrics


def update_metrics(
    totals: Mapping[str, float],
    stats: Mapping[str, float],
    *,
    scale: float,
    global_step: int,
    config: ActorConfig,
) -> dict[str, float]:
    """``finish_step``'s metrics: the step's totals (losses rescaled by ``scale``, the
    provisional / final denominator) and the optimizer's ``stats``."""
    tokens = totals["tokens"]
    out = {
        "loss/pg": totals["pg"] * scale,
        "actor/grad_norm": stats["grad_norm"],
        "actor/lr": stats["lr"],
        "actor/clipfrac": totals["clipfrac"] / tokens,
        "actor/approx_kl": totals["approx_kl"] / tokens,
        "actor/valid_tokens": tokens,
        "actor/step": float(global_step),
    }
    if config.use_reference:
        out["loss/kl"] = totals["kl"] * scale
    if config.entropy_coef > 0:
        out["loss/entropy"] = totals["entropy"] * scale
    return out
