"""The actor's loss on one micro-batch: the clipped policy loss, plus the KL loss against
the reference model and the entropy bonus when configured, and the engine-vs-trainer
k3 estimate when the generation engine's log-probs came along."""

from __future__ import annotations

from typing import cast

from torch import Tensor

from ppo_trainer._backend import Batch
from ppo_trainer._batching import logprobs_fn, shift
from ppo_trainer._config import ActorConfig
from ppo_trainer._math import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    masked_sum,
    policy_loss,
)

__all__ = ["actor_loss"]


def actor_loss(
    logits: Tensor, mb: Batch, *, config: ActorConfig, denominator: float, keep: bool = False
) -> tuple[Tensor, dict[str, float]]:
    """``(loss, sums)`` of one micro-batch (``logits: [b, T, V]`` native, ``mb``'s tensors
    ``[b, T]`` shifted), the loss divided by the step's ``denominator``.

    ``sums``: ``pg``, ``kl``, ``entropy`` (the loss terms, 0.0 when not configured),
    ``clipfrac`` and ``approx_kl`` times the micro-batch's valid tokens, and ``kl_engine``
    (with ``engine_logprobs``). Without ``old_logprobs`` in ``mb`` the old log-probs are
    this forward's own, detached; ``keep=True`` stores them into ``mb`` for later epochs.
    """
    cfg = config
    mask = mb["loss_mask"]
    logprobs = logprobs_fn(logits, mb)
    old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()
    if keep:  # the later epochs' old log-probs (the same tensor this epoch uses)
        cast("dict[str, Tensor]", mb)["old_logprobs"] = old
    pl = policy_loss(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=mb["advantages"],
        mask=mask,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        dual_clip=cfg.dual_clip,
        loss_agg=cfg.loss_agg,
        denominator=denominator,
    )
    loss = pl.pg_loss
    n = float(mask.sum().item())
    out = {
        "pg": float(pl.pg_loss.item()),
        "kl": 0.0,
        "entropy": 0.0,
        "clipfrac": float(pl.clipfrac.item()) * n,
        "approx_kl": float(pl.approx_kl.item()) * n,
    }
    if cfg.use_reference:
        kl = kl_penalty(
            logprobs=logprobs,
            ref_logprobs=mb["ref_logprobs"],
            estimator=cfg.kl_estimator,
            mask=mask,
        )
        kl_loss = aggregate_loss(loss=kl, mask=mask, mode=cfg.loss_agg, denominator=denominator)
        loss = loss + cfg.kl_loss_coef * kl_loss
        out["kl"] = float(kl_loss.item())
    if cfg.entropy_coef > 0:
        ent = shift(entropy_from_logits(logits=logits))
        ent_loss = aggregate_loss(loss=ent, mask=mask, mode=cfg.loss_agg, denominator=denominator)
        loss = loss - cfg.entropy_coef * ent_loss
        out["entropy"] = float(ent_loss.item())
    if "engine_logprobs" in mb:
        out["kl_engine"] = _engine_k3_sum(mb, old=old, mask=mask)
    return loss, out


def _engine_k3_sum(mb: Batch, *, old: Tensor, mask: Tensor) -> float:
    """The sum over valid tokens of k3 of ``d = old - engine`` (float64)."""
    # kl_penalty's log_r = ref_logprobs - logprobs
    k3 = kl_penalty(
        logprobs=mb["engine_logprobs"],
        ref_logprobs=old.double(),
        estimator="k3",
        mask=mask,
    )
    return float(masked_sum(values=k3, mask=mask.double()).item())
