"""The actor worker: the policy (and, with a KL loss, the frozen reference model) on one
rank, with chunked gradient accumulation over one step.

Every method works on CPU tensors in and out (``[B, T]``, shifted layout of
docs/interfaces.md); the backend moves them to its device.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from functools import partial
from typing import NamedTuple

from ppo_lifecycle import BACKWARD_PARTS, FORWARD_PARTS, Part, Role
from torch import Tensor

from ppo_trainer._actor_loss import actor_loss
from ppo_trainer._actor_step import (
    StepSums,
    check_final_denominator,
    chunk_metrics,
    final_denominator,
    update_metrics,
)
from ppo_trainer._backend import FrozenModel, TrainModel
from ppo_trainer._batching import (
    check_batch,
    cpu_cat,
    logprobs_fn,
    micro_batches,
    rows,
    valid_counts,
)
from ppo_trainer._config import ActorConfig
from ppo_trainer._kept_chunks import KeptChunks
from ppo_trainer._worker_base import WorkerBase, lifecycle_options, refuse_non_finite

__all__ = ["ActorWorker"]


class _ChunkLogprobs(NamedTuple):
    """The optional ``[B, T]`` log-probs of one ``train_chunk`` call (names as its keywords)."""

    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    engine_logprobs: Tensor | None


class ActorWorker(WorkerBase):
    """The policy on one rank.

    One step: any number of ``train_chunk`` calls (chunks), each with the same
    ``loss_denominator``, then one ``finish_step``. Gradients accumulate across chunks and
    stay resident through ``sleep(parts=KEEP_GRADIENTS)``. Several policy epochs while
    streaming: the chunks pass ``keep=True``, and after ``finish_step`` one
    ``train_epochs(epochs=K - 1)`` runs the other epochs over the kept chunks. ``compute_logprobs``,
    ``train_chunk``, ``finish_step`` and ``export_weights`` take the lifecycle options
    ``wake_first`` / ``sleep_after`` and record ``last_timeline()``.
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
        self._counters = {"policy_forward": 0, "policy_forward_backward": 0, "reference_forward": 0}
        super().__init__(
            config,
            role=Role.ACTOR,
            rank=rank,
            world_size=world_size,
            dist_init_method=dist_init_method,
        )
        self._policy: TrainModel = self._backend.build_policy()
        self._reference: FrozenModel | None = (
            self._backend.build_reference() if config.use_reference else None
        )
        self._step = StepSums()
        self._kept = KeptChunks()  # train_chunk(keep=True), for train_epochs

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        out: list[tuple[FrozenModel, bool]] = [(self._policy, True)]
        if self._reference is not None:
            out.append((self._reference, False))
        return out

    def counters(self) -> dict[str, int]:
        """Samples (rows) that went through each pass since construction:
        ``policy_forward`` (no-grad log-prob forward: ``compute_logprobs``),
        ``policy_forward_backward`` (``train_chunk``), ``reference_forward``
        (``compute_ref_logprobs``, or inside ``train_chunk``). Rows of micro-batches
        skipped for having no valid token are not counted."""
        return dict(self._counters)

    def _split(self, tensors: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        return micro_batches(
            tensors, size=self.config.micro_batch_size, device=self._backend.device
        )

    # ---- forward passes

    @lifecycle_options
    def compute_logprobs(
        self,
        batch: Mapping[str, Tensor],
        *,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
    ) -> Tensor:
        """Log-probs of the current policy: ``[B, T]`` float32 on the CPU, column 0 = 0.

        Only needed for several policy epochs over one batch (the old log-probs of every
        epoch) or diagnostics: ``train_chunk`` without ``old_logprobs`` uses its own
        forward's."""
        self._require_awake("compute_logprobs", FORWARD_PARTS)
        check_batch(batch, ("input_ids", "attention_mask"))
        mbs = self._split(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        )
        out = cpu_cat(
            self._policy.forward(mbs, fn=logprobs_fn), attention_mask=batch["attention_mask"]
        )
        self._counters["policy_forward"] += rows(mbs)
        return out

    def compute_ref_logprobs(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Log-probs of the frozen reference model (only with ``kl_loss_coef > 0``)."""
        self._require_awake("compute_ref_logprobs", FORWARD_PARTS)
        reference = self._require_reference()
        check_batch(batch, ("input_ids", "attention_mask"))
        mbs = self._split(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        )
        out = cpu_cat(
            reference.forward(mbs, fn=logprobs_fn), attention_mask=batch["attention_mask"]
        )
        self._counters["reference_forward"] += rows(mbs)
        return out

    def _require_reference(self) -> FrozenModel:
        if self._reference is None:
            raise ValueError(
                f"kl_loss_coef={self.config.kl_loss_coef!r}: no reference model is built; set "
                "actor.kl_loss_coef > 0 to use the KL loss"
            )
        return self._reference

    # ---- training

    @lifecycle_options
    def train_chunk(
        self,
        batch: Mapping[str, Tensor],
        *,
        advantages: Tensor,
        loss_denominator: float,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        engine_logprobs: Tensor | None = None,
        keep: bool = False,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
    ) -> dict[str, float]:
        """Accumulate the gradient of this chunk's share of the step loss (no update).

        ``batch`` needs ``input_ids``, ``attention_mask``, ``loss_mask`` (``[B, T]``);
        ``advantages`` and the optional log-probs are ``[B, T]`` in the same layout. The
        loss is divided by ``loss_denominator``: the WHOLE step's valid-token count over
        all chunks and ranks (``loss_agg="token"``) or its sample count (``"sample"``),
        see ``loss_denominator()``. A chunk without a valid token adds no gradient (and
        runs no forward).

        ``old_logprobs=None`` (streaming, one policy epoch): the old log-probs are this
        forward's own, detached (ratio exactly 1, as slime does), so no separate log-prob
        forward runs; the gradients are bit-identical to passing ``compute_logprobs(batch)``
        of the same weights. With ``kl_loss_coef > 0`` and ``ref_logprobs=None`` the
        reference forward runs here, in the same call. ``engine_logprobs``: the generation
        engine's log-probs of the sampled tokens; adds
        ``"rollout/kl_engine_trainer_sum"``, the sum over valid tokens of the k3 estimate
        ``exp(d) - 1 - d``, ``d = old_logprobs - engine_logprobs`` (float64).

        ``keep=True``: this rank also keeps the chunk (its micro-batches on the CPU, with
        the advantages, the reference log-probs when a KL loss is used, and the old
        log-probs: this forward's own, detached, or the ``old_logprobs`` given) for the
        later policy epochs of the step, ``train_epochs``. Nothing extra is returned:
        the old log-probs stay on the rank that computed them. The first chunk of a step
        drops whatever an earlier, unfinished step kept.

        Returns this chunk's metrics. Sums over the chunk (add them up over chunks and
        data-parallel ranks): ``actor/valid_tokens``, ``rollout/kl_engine_trainer_sum``
        and the losses ``loss/pg``, ``loss/kl`` (with ``kl_loss_coef > 0``),
        ``loss/entropy`` (with ``entropy_coef > 0``): this chunk's share of the step loss,
        already divided by ``loss_denominator`` (the shares add up to the step's loss).
        Means over the chunk's valid tokens (weight by ``actor/valid_tokens`` to combine):
        ``actor/clipfrac``, ``actor/approx_kl``.
        """
        self._require_awake("train_chunk", BACKWARD_PARTS)
        given = _ChunkLogprobs(old_logprobs, ref_logprobs, engine_logprobs)
        mask = self._open_chunk(batch, advantages, given, loss_denominator, keep=keep)
        tokens, samples = valid_counts(mask)
        summed = None  # a chunk without a valid token runs nothing
        if tokens != 0:
            mbs = self._chunk_micro_batches(batch, mask, advantages, given)
            summed = self._chunk_backward(mbs, tokens=tokens, samples=samples, keep=keep)
        engine = engine_logprobs is not None
        return chunk_metrics(tokens=tokens, summed=summed, config=self.config, engine=engine)

    def _open_chunk(
        self,
        batch: Mapping[str, Tensor],
        advantages: Tensor,
        given: _ChunkLogprobs,
        loss_denominator: float,
        *,
        keep: bool,
    ) -> Tensor:
        """Check a chunk and count it into the step (the first chunk of a step drops the
        chunks a stale step kept); returns its loss mask as float ``[B, T]``."""
        keys = ("input_ids", "attention_mask", "loss_mask")
        check_batch(batch, keys, advantages=advantages, **given._asdict())
        self._step.use_denominator(loss_denominator, loss_agg=self.config.loss_agg)
        mask = batch["loss_mask"].float()
        if self._step.chunks == 0:
            self._kept = KeptChunks()  # a new step (an aborted one's chunks are stale)
        self._step.chunks += 1
        self._step.sums["rows"] += float(mask.shape[0])
        if keep:
            self._kept.add_rows(float(mask.shape[0]))
        return mask

    def _chunk_micro_batches(
        self, batch: Mapping[str, Tensor], mask: Tensor, advantages: Tensor, given: _ChunkLogprobs
    ) -> list[dict[str, Tensor]]:
        """The chunk's micro-batches with a valid token, on the device, with the
        reference log-probs (given, or from the reference forward that runs here)."""
        tensors = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "loss_mask": mask,
            "advantages": advantages.float(),
        }
        use_reference = self.config.use_reference
        if given.old_logprobs is not None:
            tensors["old_logprobs"] = given.old_logprobs.float()
        if use_reference and given.ref_logprobs is not None:
            tensors["ref_logprobs"] = given.ref_logprobs.float()
        if given.engine_logprobs is not None:
            tensors["engine_logprobs"] = given.engine_logprobs.double()
        mbs = [mb for mb in self._split(tensors) if bool(mb["loss_mask"].any())]
        if use_reference and given.ref_logprobs is None:
            reference = self._require_reference()
            for mb, ref in zip(mbs, reference.forward(mbs, fn=logprobs_fn), strict=True):
                mb["ref_logprobs"] = ref
            self._counters["reference_forward"] += rows(mbs)
        return mbs

    def _chunk_backward(
        self, mbs: list[dict[str, Tensor]], *, tokens: float, samples: float, keep: bool
    ) -> dict[str, float]:
        """Forward + backward of the micro-batches into the step's gradients and sums;
        with ``keep`` the micro-batches (now holding the old log-probs) are kept."""
        assert self._step.denominator is not None  # use_denominator ran
        loss_fn = partial(
            actor_loss, config=self.config, denominator=self._step.denominator, keep=keep
        )
        results = self._policy.forward_backward(mbs, loss_fn=loss_fn)
        self._counters["policy_forward_backward"] += rows(mbs)
        summed = self._step.add(results, tokens=tokens, samples=samples)
        if keep:  # the old log-probs were put into each micro-batch by actor_loss
            self._kept.add(mbs, tokens=tokens, samples=samples)
        return summed

    @lifecycle_options
    def train_epochs(
        self,
        *,
        epochs: int,
        loss_denominator: float,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
    ) -> dict[str, float]:
        """Policy epochs 2..K of a streamed step, after its ``finish_step``: ``epochs``
        passes over the chunks this rank kept (``train_chunk(keep=True)``), each a
        forward + backward with the kept old log-probs and advantages followed by one
        optimizer + scheduler update exactly as ``finish_step`` makes it. The kept
        chunks are dropped afterwards.

        The computation is that of ``epochs`` more full-batch epochs over the assembled
        step: the weights did not change between the streamed chunks, so each chunk's
        own forward gave the old log-probs, and no log-prob forward runs here.
        ``loss_denominator``: the whole step's final count over all ranks (the true one,
        as ``finish_step`` checks). Returns the last update's metrics (``finish_step``'s).
        Raises ``ValueError`` when nothing was kept on any rank, or when a step is still
        open (``train_chunk`` without ``finish_step``).
        """
        self._require_awake("train_epochs")
        self._check_epochs(epochs)
        out: dict[str, float] = {}
        try:
            for _ in range(epochs):
                out = self._kept_epoch(float(loss_denominator))
        finally:
            self._kept = KeptChunks()
        return out

    def _check_epochs(self, epochs: int) -> None:
        """``train_epochs``' refusals: a bad count, an open step, nothing kept anywhere."""
        if not (isinstance(epochs, int) and epochs >= 1):
            raise ValueError(
                f"epochs={epochs!r} is invalid: pass the number of epochs after the first (>= 1)"
            )
        if self._step.chunks:
            raise ValueError(
                "train_epochs() with an open step: call finish_step() after the chunks first "
                "(epoch 1's update), then train_epochs() for the others"
            )
        (kept_rows,) = self._backend.all_reduce_sum([self._kept.counts["rows"]])
        if kept_rows == 0:
            raise ValueError(
                "train_epochs(): no chunk was kept on any rank; pass keep=True to every "
                "train_chunk() of the step"
            )

    def _kept_epoch(self, denominator: float) -> dict[str, float]:
        """One epoch over the kept chunks (as one chunk of a step), then its update."""
        self._step.denominator = denominator
        self._step.chunks = 1
        counts = self._kept.counts
        self._step.sums["rows"] += counts["rows"]
        if self._kept.micro_batches:
            mbs = self._kept.on_device(self._backend.device)
            loss_fn = partial(actor_loss, config=self.config, denominator=denominator)
            results = self._policy.forward_backward(mbs, loss_fn=loss_fn)
            self._counters["policy_forward_backward"] += rows(mbs)
            self._step.add(results, tokens=counts["tokens"], samples=counts["samples"])
        return self._finish(None)

    @lifecycle_options
    def finish_step(
        self,
        *,
        loss_denominator: float | None = None,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
    ) -> dict[str, float]:
        """All-reduce (SUM) the accumulated gradients over the data-parallel ranks, clip
        the norm, one optimizer + scheduler step, zero the gradients.

        ``loss_denominator``: the true whole-step count when it was not known at the
        first ``train_chunk`` (streaming with ``loss_agg="token"``: the count is known only
        after the last chunk). The chunks then passed any provisional positive value and
        the gradients (and loss metrics) are rescaled by ``provisional / true`` before
        the all-reduce, which is exact because the gradient is linear in the loss scale.
        ``None``: the denominator given to ``train_chunk`` is final.

        The final denominator must equal the step's count over all chunks and ranks:
        ``token``: valid tokens; ``sample``: samples (all of them, or only those with a
        valid token). Raises ``ValueError`` otherwise and ``EmptyStepError`` when the
        step had no valid token on any rank, both before any update (gradients zeroed).
        """
        self._require_awake("finish_step")
        return self._finish(loss_denominator)

    def _finish(self, loss_denominator: float | None) -> dict[str, float]:
        """Close the step: check its denominator, rescale, reduce, update; its metrics."""
        check_final_denominator(loss_denominator)
        totals = self._step.totals(self._backend.all_reduce_sum)
        provisional = self._step.denominator
        self._step = StepSums()
        try:
            final = final_denominator(
                totals,
                provisional=provisional,
                given=loss_denominator,
                loss_agg=self.config.loss_agg,
            )
        except ValueError:  # EmptyStepError too: no update, the gradients are discarded
            self._policy.zero_grad()
            raise
        assert provisional is not None  # final_denominator checked it
        scale = provisional / final
        if scale != 1.0:
            self._policy.scale_grads(scale)
        stats = self._update(totals)
        return update_metrics(
            totals, stats, scale=scale, global_step=self.global_step, config=self.config
        )

    def _update(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Refuse non-finite losses or gradient norm, reduce, one optimizer step."""
        where = f"ActorWorker.finish_step() (policy update {self.global_step + 1})"
        losses = {"loss/pg": totals["pg"], "loss/kl": totals["kl"]}
        refuse_non_finite(self._policy, where, {**losses, "loss/entropy": totals["entropy"]})
        self._policy.all_reduce_grads()
        refuse_non_finite(self._policy, where, {"actor/grad_norm": self._policy.grad_norm()})
        stats = self._policy.step()
        self._policy.zero_grad()
        self.global_step += 1
        return stats

    def grads(self) -> dict[str, Tensor]:
        """The accumulated local gradients by parameter name (tests and diagnostics)."""
        return self._policy.grads()

    # ---- weights, checkpoints

    @lifecycle_options
    def export_weights(
        self,
        *,
        wake_first: bool | Iterable[Part] = False,
        sleep_after: Iterable[Part] | None = None,
    ) -> dict[str, Tensor] | None:
        """The policy weights under Hugging Face ``state_dict()`` names, CPU tensors (refit).

        A collective over the whole group: EVERY rank must call it (Megatron gathers the
        tensor- and pipeline-parallel shards; a rank that does not call it leaves its
        peers waiting). Returns the state dict on global rank 0 and ``None`` on every
        other rank, so only one copy is shipped. Only the model-parallel group of rank 0
        gathers and copies; the other data-parallel shards return at once."""
        self._require_awake("export_weights", FORWARD_PARTS)
        mesh = self._backend.mesh
        if mesh.dp_rank != 0:
            return None
        weights = self._policy.export_hf()  # collective over rank 0's TP x PP group
        return weights if mesh.rank == 0 else None

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Replace the policy weights by an HF-named state dict (optimizer untouched)."""
        self._require_awake("load_weights")
        self._policy.load_hf(state)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer and scheduler (safetensors + JSON under
        ``path/rank{rank:05d}``). Must be called between steps, while awake."""
        self._require_awake("save_checkpoint")
        if self._step.chunks:
            raise RuntimeError(
                "save_checkpoint() in the middle of a step (train_chunk without finish_step); "
                "checkpoints cover whole updates only"
            )
        self._write_checkpoint(path, model=self._policy, config=self.config.to_dict())

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what ``save_checkpoint`` wrote (the reference model stays the initial one)."""
        self._require_awake("load_checkpoint")
        self._read_checkpoint(path, model=self._policy)
        self._step = StepSums()
        self._kept = KeptChunks()
