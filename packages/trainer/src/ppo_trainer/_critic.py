"""The critic worker: the value model on one rank, its value forward and its PPO epochs
over the assembled full batch (one optimizer update per mini-batch).

Every method works on CPU tensors in and out (``[B, T]``, shifted layout of
docs/interfaces.md); the backend moves them to its device.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from functools import partial

from ppo_lifecycle import FORWARD_PARTS, Part, Role
from torch import Tensor

from ppo_trainer._backend import Batch, FrozenModel, TrainModel
from ppo_trainer._batching import (
    check_batch,
    cpu_cat,
    micro_batches,
    rows,
    shift,
    valid_counts,
    values_fn,
)
from ppo_trainer._config import CriticConfig
from ppo_trainer._math import masked_sum, value_loss
from ppo_trainer._worker_base import (
    EmptyStepError,
    WorkerBase,
    lifecycle_options,
    refuse_non_finite,
)

__all__ = ["CriticWorker"]


class CriticWorker(WorkerBase):
    """The value model on one rank. ``compute_values`` and ``train`` take the lifecycle
    options ``wake_first`` / ``sleep_after`` and record ``last_timeline()``."""

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
        self._counters = {"value_forward": 0, "value_forward_backward": 0}
        super().__init__(
            config,
            role=Role.CRITIC,
            rank=rank,
            world_size=world_size,
            dist_init_method=dist_init_method,
        )
        self._critic: TrainModel = self._backend.build_critic()

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        return [(self._critic, True)]

    def counters(self) -> dict[str, int]:
        """Samples (rows) that went through each pass since construction:
        ``value_forward`` (``compute_values``), ``value_forward_backward`` (``train``, one
        count per epoch; rows of micro-batches without a valid token are skipped)."""
        return dict(self._counters)

    @lifecycle_options
    def compute_values(
        self,
        batch: Mapping[str, Tensor],
        *,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
    ) -> Tensor:
        """Values of the current (unchanged) critic: ``[B, T]`` float32 CPU, column 0 = 0.

        ``values[:, t]`` is read from the hidden state at ``t - 1`` (the state before
        token ``t``). These become the old values of every critic epoch.
        """
        self._require_awake("compute_values", FORWARD_PARTS)
        check_batch(batch, ("input_ids", "attention_mask"))
        mbs = micro_batches(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
            size=self.config.micro_batch_size,
            device=self._backend.device,
        )
        out = cpu_cat(
            self._critic.forward(mbs, fn=values_fn), attention_mask=batch["attention_mask"]
        )
        self._counters["value_forward"] += rows(mbs)
        return out

    @lifecycle_options
    def train(
        self,
        batch: Mapping[str, Tensor],
        *,
        returns: Tensor,
        old_values: Tensor,
        epochs: int,
        mini_batch_size: int,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
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
        b = self._check_train(batch, returns, old_values, epochs, mini_batch_size)
        tensors = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "loss_mask": batch["loss_mask"].float(),
            "returns": returns.float(),
            "old_values": old_values.float(),
        }
        sums = dict.fromkeys(("v_loss", "clipfrac", "tokens", "grad_norm", "steps", "lr"), 0.0)
        for epoch in range(epochs):
            for start in range(0, b, mini_batch_size):
                mini = {k: v[start : start + mini_batch_size] for k, v in tensors.items()}
                where = f"epoch {epoch + 1}, mini-batch {start // mini_batch_size + 1}"
                self._train_mini_batch(mini, sums, where=where)
        steps = max(sums["steps"], 1.0)
        return {
            "loss/value": sums["v_loss"] / steps,
            "critic/clipfrac": sums["clipfrac"] / max(sums["tokens"], 1.0),
            "critic/grad_norm": sums["grad_norm"] / steps,
            "critic/lr": sums["lr"],
            "critic/optimizer_steps": sums["steps"],
        }

    def _check_train(
        self,
        batch: Mapping[str, Tensor],
        returns: Tensor,
        old_values: Tensor,
        epochs: int,
        mini_batch_size: int,
    ) -> int:
        """``train``'s refusals (shapes, counts, uneven shards, an all-masked batch over
        all ranks); returns this rank's sample count B."""
        keys = ("input_ids", "attention_mask", "loss_mask")
        b = check_batch(batch, keys, returns=returns, old_values=old_values)
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} is invalid: use critic_ppo_epochs >= 1")
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size={mini_batch_size!r} is invalid: use an integer >= 1")
        total_b, total_b2 = self._backend.all_reduce_sum([float(b), float(b * b)])
        if total_b * total_b != total_b2 * self._backend.mesh.dp_size:
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
        return b

    def _train_mini_batch(self, mini: Batch, sums: dict[str, float], *, where: str) -> None:
        """One optimizer update on a mini-batch (none when it has no valid token on any
        rank), added to ``sums``; ``where``: its epoch and index, for the refusals."""
        tokens, samples = self._backend.all_reduce_sum(list(valid_counts(mini["loss_mask"])))
        if tokens == 0:
            return
        denominator = tokens if self.config.loss_agg == "token" else samples
        mbs = [
            mb
            for mb in micro_batches(
                mini, size=self.config.micro_batch_size, device=self._backend.device
            )
            if bool(mb["loss_mask"].any())
        ]
        results = self._critic.forward_backward(
            mbs, loss_fn=partial(self._loss, denominator=denominator)
        )
        self._counters["value_forward_backward"] += rows(mbs)
        v_loss, clip = self._backend.all_reduce_sum(
            [sum(r["v_loss"] for r in results), sum(r["clipfrac"] for r in results)]
        )
        where = f"CriticWorker.train() ({where}, after {int(sums['steps'])} update(s))"
        refuse_non_finite(self._critic, where, {"loss/value": v_loss})
        self._critic.all_reduce_grads()
        grad_norm = self._critic.grad_norm()
        refuse_non_finite(self._critic, where, {"critic/grad_norm": grad_norm})
        stats = self._critic.step()
        self._critic.zero_grad()
        self.global_step += 1
        sums["lr"] = stats["lr"]
        sums["v_loss"] += v_loss
        sums["clipfrac"] += clip
        sums["tokens"] += tokens
        sums["grad_norm"] += stats["grad_norm"]
        sums["steps"] += 1

    def _loss(
        self, values: Tensor, mb: Batch, denominator: float
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        vl = value_loss(
            values=shift(values),
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
        """The critic weights under Hugging Face names (``model.*``, ``score.*``), CPU tensors,
        on every rank that calls it. With tensor / pipeline parallelism a collective: every
        rank of a model-parallel group must call it."""
        self._require_awake("export_weights", FORWARD_PARTS)
        return self._critic.export_hf()

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Replace the critic weights by an HF-named state dict (optimizer untouched)."""
        self._require_awake("load_weights")
        self._critic.load_hf(state)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer and scheduler under ``path/rank{rank:05d}`` (no pickle)."""
        self._require_awake("save_checkpoint")
        self._write_checkpoint(path, model=self._critic, config=self.config.to_dict())

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what ``save_checkpoint`` wrote."""
        self._require_awake("load_checkpoint")
        self._read_checkpoint(path, model=self._critic)
