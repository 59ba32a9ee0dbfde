"""Actor and critic workers: the PPO mechanism the driver drives, one instance per rank.

The driver owns the plan (when to sleep, when to save, chunk boundaries, the step's
loss denominator); the workers own the mechanism. Every method works on CPU tensors
in and out (``[B, T]``, shifted layout of docs/interfaces.md); the backend moves them
to its device. Model memory is moved only by ``sleep`` / ``wake_up`` (idempotent).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_trainer._backend import Backend, Batch, FrozenModel, TrainModel, get_backend
from ppo_trainer._config import ActorConfig, CriticConfig
from ppo_trainer._math import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_sum,
    policy_loss,
    value_loss,
)
from ppo_trainer._parts import ALL_PARTS, Part, parts_from
from ppo_trainer._serialize import load_state, save_state

__all__ = ["ActorWorker", "CriticWorker", "EmptyStepError", "loss_denominator"]

log = logging.getLogger(__name__)

_CHECKPOINT_FORMAT = 1


class EmptyStepError(ValueError):
    """A step (or ``train`` call) without a single valid token: nothing may be updated."""


def loss_denominator(*, loss_mask: Tensor, loss_agg: str) -> float:
    """The denominator the driver passes to every ``backward`` of one step.

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


# --------------------------------------------------------------------------- helpers


def _check_batch(batch: Mapping[str, Tensor], keys: Sequence[str], **extra: Tensor | None) -> int:
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


def _micro_batches(
    tensors: Mapping[str, Tensor], *, size: int, device: torch.device
) -> list[dict[str, Tensor]]:
    n = int(next(iter(tensors.values())).shape[0])
    out = []
    for start in range(0, n, size):
        out.append({k: v[start : start + size].to(device) for k, v in tensors.items()})
    return out


def _shift(native: Tensor) -> Tensor:
    """Native ``[b, T]`` (position t about token t+1) -> shifted ``[b, T]``, column 0 = 0."""
    return torch.cat([native.new_zeros(native.shape[0], 1), native[:, :-1]], dim=1)


def _logprobs_fn(logits: Tensor, mb: Batch) -> Tensor:
    """Shifted log-probs ``[b, T]`` from native logits ``[b, T, V]``."""
    ids = mb["input_ids"]
    lp = logprobs_from_logits(logits=logits[:, :-1], labels=ids[:, 1:])
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def _values_fn(values: Tensor, mb: Batch) -> Tensor:
    return _shift(values)


def _cpu_cat(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.to("cpu") for p in parts], dim=0)


def _refuse_non_finite(model: TrainModel, where: str, values: Mapping[str, float]) -> None:
    """Raise ``FloatingPointError`` naming the first non-finite quantity, BEFORE the
    optimizer step (the accumulated gradients are discarded): a non-finite loss or
    gradient norm would otherwise be clipped to a silent no-op or poison the weights."""
    for name, value in values.items():
        if not math.isfinite(value):
            model.zero_grad()
            raise FloatingPointError(
                f"{where}: {name} = {value!r} is not finite; no optimizer step was taken "
                "(gradients discarded). Look for rewards, returns or advantages far out of "
                "range (e.g. a reward function returning huge values)"
            )


class _Lifecycle:
    """Idempotent sleep/wake_up shared by both workers (models are moved by the backend).

    Implements ``ppo_lifecycle.Offloadable``: parts already off the device are skipped,
    so ``sleep(parts=KEEP_GRADIENTS)`` followed by ``sleep()`` also offloads the
    gradients; a sleep with nothing left to move is a logged no-op.
    """

    _backend: Backend
    _asleep_parts: frozenset[Part]
    _name: str

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        """(model, is_the_trained_one)."""
        raise NotImplementedError

    @property
    def is_asleep(self) -> bool:
        """Whether any part of the worker's model memory is offloaded."""
        return bool(self._asleep_parts)

    @property
    def asleep_parts(self) -> frozenset[Part]:
        """The parts of the trained model currently off the device."""
        return self._asleep_parts

    def sleep(self, *, parts: Iterable[Part] | None = None) -> None:
        """Offload ``parts`` (default: all) of the trained model, and all of the frozen
        reference model. Parts already offloaded are skipped (logged no-op)."""
        todo = parts_from(parts) - self._asleep_parts
        if not todo:
            log.info("%s.sleep() while already offloaded: nothing to do", self._name)
            return
        first = not self._asleep_parts
        for model, trained in self._models():
            if trained:
                model.offload(todo)
            elif first:
                model.offload(ALL_PARTS)
        if first:
            self._backend.release_process_groups()
        self._asleep_parts = self._asleep_parts | todo

    def wake_up(self) -> None:
        """Bring everything back. While already resident it only re-establishes the
        process groups (a retry after a failure between wake_up and sleep)."""
        if not self._asleep_parts:
            log.info("%s.wake_up() while resident: ensuring process groups only", self._name)
            self._backend.restore_process_groups()
            return
        for model, _ in self._models():
            model.onload()
        self._backend.restore_process_groups()
        self._asleep_parts = frozenset()

    def _require_awake(self, what: str) -> None:
        if self._asleep_parts:
            raise RuntimeError(
                f"{self._name}.{what}() called while asleep "
                f"({sorted(p.value for p in self._asleep_parts)} offloaded): the driver must "
                "call wake_up() first"
            )


def _save(path: str | os.PathLike[str], rank: int, state: dict[str, Any]) -> None:
    save_state(Path(path) / f"rank{rank:05d}", state)


def _load(path: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    d = Path(path) / f"rank{rank:05d}"
    if not (d / "state.json").is_file():
        raise FileNotFoundError(f"no checkpoint for rank {rank} under {path} (expected {d})")
    state: dict[str, Any] = load_state(d)
    if state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {d} has format {state.get('format')!r}, expected 1")
    return state


# --------------------------------------------------------------------------- actor


class ActorWorker(_Lifecycle):
    """The policy on one data-parallel rank.

    One step: any number of ``backward`` calls (chunks), each with the same
    ``loss_denominator``, then one ``finish_step``. Gradients accumulate across chunks and
    stay resident through ``sleep(parts=KEEP_GRADIENTS)``.
    """

    def __init__(
        self,
        config: ActorConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: str | None = None,
    ) -> None:
        if not isinstance(config, ActorConfig):
            raise ValueError(f"config must be an ActorConfig, got {type(config).__name__}")
        self.config = config
        self.rank = rank
        self._name = "ActorWorker"
        self._asleep_parts: frozenset[Part] = frozenset()
        self._backend = get_backend(config.backend)(
            config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
        )
        self._policy: TrainModel = self._backend.build_policy()
        self._reference: FrozenModel | None = (
            self._backend.build_reference() if config.use_reference else None
        )
        self.global_step = 0
        self._reset_step()

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        out: list[tuple[FrozenModel, bool]] = [(self._policy, True)]
        if self._reference is not None:
            out.append((self._reference, False))
        return out

    def _reset_step(self) -> None:
        self._denominator: float | None = None
        self._chunks = 0
        self._sums: dict[str, float] = {
            "tokens": 0.0,
            "samples": 0.0,
            "rows": 0.0,
            "pg": 0.0,
            "kl": 0.0,
            "entropy": 0.0,
            "clipfrac": 0.0,
            "approx_kl": 0.0,
        }

    # ---- forward passes

    def compute_logprobs(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Log-probs of the current policy: ``[B, T]`` float32 on the CPU, column 0 = 0."""
        self._require_awake("compute_logprobs")
        _check_batch(batch, ("input_ids", "attention_mask"))
        mbs = _micro_batches(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
            size=self.config.micro_batch_size,
            device=self._backend.device,
        )
        return _cpu_cat(self._policy.forward(mbs, fn=_logprobs_fn))

    def compute_ref_logprobs(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Log-probs of the frozen reference model (only with ``kl_loss_coef > 0``)."""
        self._require_awake("compute_ref_logprobs")
        if self._reference is None:
            raise ValueError(
                f"kl_loss_coef={self.config.kl_loss_coef!r}: no reference model is built; set "
                "actor.kl_loss_coef > 0 to use the KL loss"
            )
        _check_batch(batch, ("input_ids", "attention_mask"))
        mbs = _micro_batches(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
            size=self.config.micro_batch_size,
            device=self._backend.device,
        )
        return _cpu_cat(self._reference.forward(mbs, fn=_logprobs_fn))

    # ---- training

    def backward(
        self,
        batch: Mapping[str, Tensor],
        *,
        old_logprobs: Tensor,
        advantages: Tensor,
        ref_logprobs: Tensor | None = None,
        loss_denominator: float,
    ) -> dict[str, float]:
        """Accumulate the gradient of this chunk's share of the step loss (no update).

        ``batch`` needs ``input_ids``, ``attention_mask``, ``loss_mask`` (``[B, T]``);
        ``old_logprobs``, ``advantages`` (and ``ref_logprobs`` when ``kl_loss_coef > 0``)
        are ``[B, T]`` in the same layout. The loss is divided by ``loss_denominator``:
        the WHOLE step's valid-token count over all chunks and ranks (``loss_agg="token"``)
        or its sample count (``"sample"``), see ``loss_denominator()``. A chunk without a
        valid token adds no gradient. Returns this chunk's metrics.
        """
        self._require_awake("backward")
        cfg = self.config
        _check_batch(
            batch,
            ("input_ids", "attention_mask", "loss_mask"),
            old_logprobs=old_logprobs,
            advantages=advantages,
            ref_logprobs=ref_logprobs,
        )
        if not (isinstance(loss_denominator, int | float) and loss_denominator > 0):
            raise ValueError(
                f"loss_denominator={loss_denominator!r} is invalid: pass the whole step's "
                f"positive {'valid-token' if cfg.loss_agg == 'token' else 'sample'} count"
            )
        if self._denominator is None:
            self._denominator = float(loss_denominator)
        elif not math.isclose(self._denominator, float(loss_denominator)):
            raise ValueError(
                f"loss_denominator={loss_denominator!r} differs from {self._denominator!r} given "
                "earlier in this step: every chunk of a step must pass the same (whole-step) count"
            )
        if cfg.use_reference and ref_logprobs is None:
            raise ValueError(
                f"ref_logprobs=None with kl_loss_coef={cfg.kl_loss_coef!r}: pass "
                "compute_ref_logprobs(batch) for the KL loss"
            )
        mask = batch["loss_mask"].float()
        tokens = float(mask.sum().item())
        samples = float((mask.sum(dim=1) > 0).sum().item())
        metrics = {"actor/valid_tokens": tokens, "loss/pg": 0.0}
        self._chunks += 1
        self._sums["rows"] += float(mask.shape[0])
        if tokens == 0:
            return metrics
        tensors = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "loss_mask": mask,
            "old_logprobs": old_logprobs.float(),
            "advantages": advantages.float(),
        }
        if cfg.use_reference:
            assert ref_logprobs is not None
            tensors["ref_logprobs"] = ref_logprobs.float()
        mbs = [
            mb
            for mb in _micro_batches(
                tensors, size=cfg.micro_batch_size, device=self._backend.device
            )
            if bool(mb["loss_mask"].any())
        ]
        denominator = self._denominator
        results = self._policy.forward_backward(
            mbs, loss_fn=partial(self._loss, denominator=denominator)
        )
        chunk = {k: sum(r[k] for r in results) for k in results[0]}
        self._sums["tokens"] += tokens
        self._sums["samples"] += samples
        for k in ("pg", "kl", "entropy", "clipfrac", "approx_kl"):
            self._sums[k] += chunk[k]
        metrics["loss/pg"] = chunk["pg"]
        metrics["actor/clipfrac"] = chunk["clipfrac"] / tokens
        metrics["actor/approx_kl"] = chunk["approx_kl"] / tokens
        return metrics

    def _loss(
        self, logits: Tensor, mb: Batch, denominator: float
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        mask = mb["loss_mask"]
        logprobs = _logprobs_fn(logits, mb)
        pl = policy_loss(
            logprobs=logprobs,
            old_logprobs=mb["old_logprobs"],
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
            ent = _shift(entropy_from_logits(logits=logits))
            ent_loss = aggregate_loss(
                loss=ent, mask=mask, mode=cfg.loss_agg, denominator=denominator
            )
            loss = loss - cfg.entropy_coef * ent_loss
            out["entropy"] = float(ent_loss.item())
        return loss, out

    def finish_step(self, *, loss_denominator: float | None = None) -> dict[str, float]:
        """All-reduce (SUM) the accumulated gradients over the data-parallel ranks, clip
        the norm, one optimizer + scheduler step, zero the gradients.

        ``loss_denominator``: the true whole-step count when it was not known at the
        first ``backward`` (streaming with ``loss_agg="token"``: the count is known only
        after the last chunk). The chunks then passed any provisional positive value and
        the gradients (and loss metrics) are rescaled by ``provisional / true`` before
        the all-reduce, which is exact because the gradient is linear in the loss scale.
        ``None``: the denominator given to ``backward`` is final.

        The final denominator must equal the step's count over all chunks and ranks:
        ``token``: valid tokens; ``sample``: samples (all of them, or only those with a
        valid token). Raises ``ValueError`` otherwise and ``EmptyStepError`` when the
        step had no valid token on any rank, both before any update (gradients zeroed).
        """
        self._require_awake("finish_step")
        if loss_denominator is not None and not (
            isinstance(loss_denominator, int | float) and loss_denominator > 0
        ):
            raise ValueError(
                f"loss_denominator={loss_denominator!r} is invalid: pass the whole step's "
                "positive count, or None to keep the one given to backward()"
            )
        s = self._sums
        keys = ("tokens", "samples", "rows", "pg", "kl", "entropy", "clipfrac", "approx_kl")
        totals = dict(zip(keys, self._backend.all_reduce_sum([s[k] for k in keys]), strict=True))
        provisional = self._denominator
        self._reset_step()
        if totals["tokens"] == 0:
            self._policy.zero_grad()
            raise EmptyStepError(
                "finish_step(): every sample of this step is masked (0 valid tokens over all "
                "ranks); no update was made. The driver must not train on an all-masked step."
            )
        assert provisional is not None  # tokens > 0 implies a backward call
        final = provisional if loss_denominator is None else float(loss_denominator)
        if self.config.loss_agg == "token":
            allowed, what = [totals["tokens"]], "valid-token count"
        else:
            allowed, what = [totals["samples"], totals["rows"]], "sample count"
        if not any(math.isclose(final, a, rel_tol=1e-9) for a in allowed):
            self._policy.zero_grad()
            raise ValueError(
                f"loss_denominator={final!r} does not match the step's {what} "
                f"{' or '.join(repr(a) for a in allowed)} over all chunks and ranks; no update "
                "was made. Pass loss_denominator(loss_mask=<whole step>, loss_agg=...)"
            )
        scale = provisional / final
        if scale != 1.0:
            scaler = getattr(self._policy, "scale_grads", None)
            if scaler is None:
                self._policy.zero_grad()
                raise NotImplementedError(
                    f"backend={self.config.backend!r} cannot rescale gradients; pass the final "
                    "loss_denominator to every backward() instead of finish_step()"
                )
            scaler(scale)
        where = f"ActorWorker.finish_step() (policy update {self.global_step + 1})"
        losses = {"loss/pg": totals["pg"], "loss/kl": totals["kl"]}
        _refuse_non_finite(self._policy, where, {**losses, "loss/entropy": totals["entropy"]})
        self._policy.all_reduce_grads()
        _refuse_non_finite(self._policy, where, {"actor/grad_norm": self._policy.grad_norm()})
        stats = self._policy.step()
        self._policy.zero_grad()
        self.global_step += 1
        tokens = totals["tokens"]
        out = {
            "loss/pg": totals["pg"] * scale,
            "actor/grad_norm": stats["grad_norm"],
            "actor/lr": stats["lr"],
            "actor/clipfrac": totals["clipfrac"] / tokens,
            "actor/approx_kl": totals["approx_kl"] / tokens,
            "actor/valid_tokens": tokens,
            "actor/step": float(self.global_step),
        }
        if self.config.use_reference:
            out["loss/kl"] = totals["kl"] * scale
        if self.config.entropy_coef > 0:
            out["loss/entropy"] = totals["entropy"] * scale
        return out

    def grads(self) -> dict[str, Tensor]:
        """The accumulated local gradients by parameter name (tests and diagnostics)."""
        return self._policy.grads()

    # ---- weights, checkpoints

    def export_weights(self) -> dict[str, Tensor]:
        """The policy weights under Hugging Face ``state_dict()`` names, CPU tensors (refit)."""
        self._require_awake("export_weights")
        return self._policy.export_hf()

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Replace the policy weights by an HF-named state dict (optimizer untouched)."""
        self._require_awake("load_weights")
        self._policy.load_hf(state)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer and scheduler (safetensors + JSON under
        ``path/rank{rank:05d}``). Must be called between steps, while awake."""
        self._require_awake("save_checkpoint")
        if self._chunks:
            raise RuntimeError(
                "save_checkpoint() in the middle of a step (backward without finish_step); "
                "checkpoints cover whole updates only"
            )
        _save(
            path,
            self.rank,
            {
                "format": _CHECKPOINT_FORMAT,
                "role": "actor",
                "global_step": self.global_step,
                "config": self.config.to_dict(),
                "backend": self._policy.checkpoint_state(),
            },
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what ``save_checkpoint`` wrote (the reference model stays the initial one)."""
        self._require_awake("load_checkpoint")
        state = _load(path, self.rank)
        if state["role"] != "actor":
            raise ValueError(f"checkpoint {path} holds a {state['role']!r}, not an actor")
        self._policy.load_checkpoint_state(state["backend"])
        self.global_step = int(state["global_step"])
        self._reset_step()


# --------------------------------------------------------------------------- critic


class CriticWorker(_Lifecycle):
    """The value model on one data-parallel rank."""

    def __init__(
        self,
        config: CriticConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: str | None = None,
    ) -> None:
        if not isinstance(config, CriticConfig):
            raise ValueError(f"config must be a CriticConfig, got {type(config).__name__}")
        self.config = config
        self.rank = rank
        self._name = "CriticWorker"
        self._asleep_parts: frozenset[Part] = frozenset()
        self._backend = get_backend(config.backend)(
            config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
        )
        self._critic: TrainModel = self._backend.build_critic()
        self.global_step = 0

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        return [(self._critic, True)]

    def compute_values(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Values of the current (unchanged) critic: ``[B, T]`` float32 CPU, column 0 = 0.

        ``values[:, t]`` is read from the hidden state at ``t - 1`` (the state before
        token ``t``). These become the old values of every critic epoch.
        """
        self._require_awake("compute_values")
        _check_batch(batch, ("input_ids", "attention_mask"))
        mbs = _micro_batches(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
            size=self.config.micro_batch_size,
            device=self._backend.device,
        )
        return _cpu_cat(self._critic.forward(mbs, fn=_values_fn))

    def train(
        self,
        batch: Mapping[str, Tensor],
        *,
        returns: Tensor,
        old_values: Tensor,
        epochs: int,
        mini_batch_size: int,
    ) -> dict[str, float]:
        """Critic PPO epochs over this rank's shard of the assembled full batch.

        ``batch`` needs ``input_ids``, ``attention_mask``, ``loss_mask``; ``returns`` and
        ``old_values`` (``[B, T]``) are frozen: every epoch uses the same ones. Each epoch
        walks the samples in order in mini-batches of ``mini_batch_size`` (per rank; every
        rank must hold the same number of samples); one optimizer + scheduler step per
        mini-batch, its loss divided by the mini-batch's valid-token (or sample) count
        over all ranks, gradients summed over ranks, norm clipped.
        """
        self._require_awake("train")
        cfg = self.config
        b = _check_batch(
            batch,
            ("input_ids", "attention_mask", "loss_mask"),
            returns=returns,
            old_values=old_values,
        )
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} is invalid: use critic_ppo_epochs >= 1")
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size={mini_batch_size!r} is invalid: use an integer >= 1")
        total_b, total_b2 = self._backend.all_reduce_sum([float(b), float(b * b)])
        if total_b * total_b != total_b2 * self._backend.dp_size:
            raise ValueError(
                f"critic shards differ in size across data-parallel ranks (this rank: {b}); "
                "split the full batch evenly over the critic ranks"
            )
        mask = batch["loss_mask"].float()
        if float(self._backend.all_reduce_sum([float(mask.sum().item())])[0]) == 0:
            raise EmptyStepError(
                "CriticWorker.train(): every sample is masked (0 valid tokens over all ranks); "
                "no update was made"
            )
        tensors = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "loss_mask": mask,
            "returns": returns.float(),
            "old_values": old_values.float(),
        }
        sums = {"v_loss": 0.0, "clipfrac": 0.0, "tokens": 0.0, "grad_norm": 0.0, "steps": 0.0}
        lr = 0.0
        for epoch in range(epochs):
            for start in range(0, b, mini_batch_size):
                mini = {k: v[start : start + mini_batch_size] for k, v in tensors.items()}
                m = mini["loss_mask"]
                local = float(m.sum().item())
                local_samples = float((m.sum(dim=1) > 0).sum().item())
                tokens, samples = self._backend.all_reduce_sum([local, local_samples])
                if tokens == 0:
                    continue
                denominator = tokens if cfg.loss_agg == "token" else samples
                mbs = [
                    mb
                    for mb in _micro_batches(
                        mini, size=cfg.micro_batch_size, device=self._backend.device
                    )
                    if bool(mb["loss_mask"].any())
                ]
                results = self._critic.forward_backward(
                    mbs, loss_fn=partial(self._loss, denominator=denominator)
                )
                v_loss, clip = self._backend.all_reduce_sum(
                    [sum(r["v_loss"] for r in results), sum(r["clipfrac"] for r in results)]
                )
                where = (
                    f"CriticWorker.train() (epoch {epoch + 1}, mini-batch "
                    f"{start // mini_batch_size + 1}, after {int(sums['steps'])} update(s))"
                )
                _refuse_non_finite(self._critic, where, {"loss/value": v_loss})
                self._critic.all_reduce_grads()
                grad_norm = self._critic.grad_norm()
                _refuse_non_finite(self._critic, where, {"critic/grad_norm": grad_norm})
                stats = self._critic.step()
                self._critic.zero_grad()
                self.global_step += 1
                lr = stats["lr"]
                sums["v_loss"] += v_loss
                sums["clipfrac"] += clip
                sums["tokens"] += tokens
                sums["grad_norm"] += stats["grad_norm"]
                sums["steps"] += 1
        steps = max(sums["steps"], 1.0)
        return {
            "loss/value": sums["v_loss"] / steps,
            "critic/clipfrac": sums["clipfrac"] / max(sums["tokens"], 1.0),
            "critic/grad_norm": sums["grad_norm"] / steps,
            "critic/lr": lr,
            "critic/optimizer_steps": sums["steps"],
        }

    def _loss(
        self, values: Tensor, mb: Batch, denominator: float
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        vl = value_loss(
            values=_shift(values),
            old_values=mb["old_values"],
            returns=mb["returns"],
            mask=mb["loss_mask"],
            value_clip=cfg.value_clip,
            loss_agg=cfg.loss_agg,
            denominator=denominator,
        )
        n = float(masked_sum(values=mb["loss_mask"], mask=mb["loss_mask"]).item())
        return vl.v_loss, {"v_loss": float(vl.v_loss.item()), "clipfrac": float(vl.clipfrac) * n}

    def grads(self) -> dict[str, Tensor]:
        """The accumulated local gradients by parameter name (tests and diagnostics)."""
        return self._critic.grads()

    def export_weights(self) -> dict[str, Tensor]:
        """The critic weights under Hugging Face names (``model.*``, ``score.*``), CPU tensors."""
        self._require_awake("export_weights")
        return self._critic.export_hf()

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Replace the critic weights by an HF-named state dict (optimizer untouched)."""
        self._require_awake("load_weights")
        self._critic.load_hf(state)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer and scheduler under ``path/rank{rank:05d}`` (no pickle)."""
        self._require_awake("save_checkpoint")
        _save(
            path,
            self.rank,
            {
                "format": _CHECKPOINT_FORMAT,
                "role": "critic",
                "global_step": self.global_step,
                "config": self.config.to_dict(),
                "backend": self._critic.checkpoint_state(),
            },
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what ``save_checkpoint`` wrote."""
        self._require_awake("load_checkpoint")
        state = _load(path, self.rank)
        if state["role"] != "critic":
            raise ValueError(f"checkpoint {path} holds a {state['role']!r}, not a critic")
        self._critic.load_checkpoint_state(state["backend"])
        self.global_step = int(state["global_step"])
