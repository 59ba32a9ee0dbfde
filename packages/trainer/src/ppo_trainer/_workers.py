"""Actor and critic workers: the PPO mechanism the driver drives, one instance per rank.

The driver owns the plan (when to sleep, when to save, chunk boundaries, the step's
loss denominator); the workers own the mechanism. Every method works on CPU tensors
in and out (``[B, T]``, shifted layout of docs/interfaces.md); the backend moves them
to its device. Model memory is moved only by ``sleep`` / ``wake_up`` (idempotent), which
the driver calls directly or asks for around one call with the lifecycle options
``wake_first`` / ``sleep_after`` (one Ray round trip per model per chunk).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch
from ppo_lifecycle import (
    ALL_PARTS,
    BACKWARD_PARTS,
    FORWARD_PARTS,
    Action,
    Part,
    Role,
    Transition,
)
from torch import Tensor

from ppo_trainer._backend import Backend, Batch, FrozenModel, Mesh, TrainModel, get_backend
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
from ppo_trainer._serialize import load_state, save_state

__all__ = ["ActorWorker", "CriticWorker", "EmptyStepError", "Timeline", "loss_denominator"]

log = logging.getLogger(__name__)

_CHECKPOINT_FORMAT = 1

Timeline = list[tuple[str, float, float]]
"""``(label, t0, t1)`` per piece of one worker call, wall-clock ``time.time()`` seconds."""


class EmptyStepError(ValueError):
    """A step (or ``train`` call) without a single valid token: nothing may be updated."""


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


def _rows(micro_batches: Sequence[Batch]) -> int:
    return sum(int(mb["input_ids"].shape[0]) for mb in micro_batches)


def _parts_from(parts: Iterable[Part | str] | None) -> frozenset[Part]:
    """Validate a ``parts=`` / ``sleep_after=`` argument (``None``: every part)."""
    if parts is None:
        return ALL_PARTS
    out: set[Part] = set()
    for item in parts:
        try:
            out.add(Part(item))
        except ValueError:
            raise ValueError(
                f"parts={item!r} is invalid: use members of ppo_lifecycle.Part "
                f"({', '.join(p.value for p in Part)})"
            ) from None
    if not out:
        raise ValueError(
            "parts=() is invalid: pass at least one Part (ALL_PARTS or KEEP_GRADIENTS)"
        )
    return frozenset(out)


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


_W = TypeVar("_W", bound="_Lifecycle")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Lifecycle:
    """Idempotent sleep/wake_up shared by both workers (models are moved by the backend),
    and the lifecycle options of their work calls (:func:`lifecycle_options`).

    Implements ``ppo_lifecycle.Offloadable``: parts already off the device are skipped,
    so ``sleep(parts=KEEP_GRADIENTS)`` followed by ``sleep()`` also puts the gradients to
    sleep; a sleep with nothing left to move is a logged no-op.
    """

    _backend: Backend
    _offload_off: bool  # offload_backend="none": sleep/wake_up move nothing
    _asleep_parts: frozenset[Part]
    _frozen_asleep: bool
    _groups_live: bool
    _name: str
    _role: Role
    _timeline: Timeline

    def _models(self) -> list[tuple[FrozenModel, bool]]:
        """(model, is_the_trained_one)."""
        raise NotImplementedError

    @property
    def is_asleep(self) -> bool:
        """Whether any part of the worker's model memory is off the device."""
        return bool(self._asleep_parts)

    @property
    def asleep_parts(self) -> frozenset[Part]:
        """The parts of the trained model currently off the device."""
        return self._asleep_parts

    def mesh(self) -> Mesh:
        """This rank's place in the group (data / tensor / pipeline parallel), from the
        backend: the driver splits rows over ``dp_rank`` only."""
        return self._backend.mesh

    def sleep(self, *, parts: Iterable[Part] | None = None) -> None:
        """Put ``parts`` (default: all) of the trained model, and all of the frozen
        reference model, to sleep (off the device). Parts already asleep are skipped
        (logged no-op). The process groups are released by the sleep that follows a
        wake-up."""
        requested = _parts_from(parts)
        todo = requested - self._asleep_parts
        if not todo:
            log.info("%s.sleep() while already asleep: nothing to do", self._name)
            return
        if self._offload_off:  # offload off (debugging): bookkeeping only
            log.info("%s.sleep(): offload_backend='none', nothing leaves the device", self._name)
            self._asleep_parts = self._asleep_parts | todo
            return
        for model, trained in self._models():
            if trained:  # all of them: a part that woke with one sharing its storage too
                model.sleep(parts=requested)
            elif not self._frozen_asleep:
                model.sleep(parts=ALL_PARTS)
        self._frozen_asleep = True
        if self._groups_live:
            self._backend.release_process_groups()
            self._groups_live = False
        self._asleep_parts = self._asleep_parts | todo

    def wake_up(self, *, parts: Iterable[Part] | None = None) -> None:
        """Bring ``parts`` (default: all) of the trained model back, and all of the
        reference model; a forward needs only ``FORWARD_PARTS`` (the optimizer state
        stays asleep). With nothing of ``parts`` asleep it only re-establishes the
        process groups (a retry after a failure between wake_up and sleep)."""
        requested = _parts_from(parts)
        todo = requested & self._asleep_parts
        if self._offload_off:  # nothing left the device
            self._asleep_parts = self._asleep_parts - todo
            return
        if not todo:
            log.info("%s.wake_up() while resident: ensuring process groups only", self._name)
            self._backend.restore_process_groups()
            self._groups_live = True
            return
        for model, trained in self._models():
            if trained:
                model.wake_up(parts=todo)
            elif self._frozen_asleep:
                model.wake_up(parts=ALL_PARTS)
        self._frozen_asleep = False
        self._backend.restore_process_groups()
        self._groups_live = True
        self._asleep_parts = self._asleep_parts - todo

    def last_timeline(self) -> Timeline:
        """The timeline of the latest call to a method that takes the lifecycle options
        ``wake_first`` / ``sleep_after`` (recorded whether or not they were passed):
        ``(label, t0, t1)`` in order, wall-clock ``time.time()`` seconds. Labels: ``"<role>.wake_up"``
        (with ``wake_first``), the method's name for the work, ``"<role>.sleep(keep_grads)"``
        / ``"<role>.sleep(all)"`` (with ``sleep_after``), worded as
        ``str(ppo_lifecycle.Transition(...))``; ``<role>`` is ``actor`` or ``critic``.
        A call that raised keeps the entries it completed. Other methods leave it alone."""
        return list(self._timeline)

    def _with_lifecycle(
        self,
        label: str,
        work: Callable[[], _R],
        *,
        wake_first: bool | Iterable[Part],
        sleep_after: Iterable[Part] | None,
    ) -> _R:
        """``wake_up(parts=...)`` if asked, the work, then ``sleep(parts=sleep_after)`` if
        asked and the work succeeded; each timed into a fresh timeline."""
        timeline: Timeline = []
        self._timeline = timeline
        parts = None if sleep_after is None else _parts_from(sleep_after)  # before any work
        wake: frozenset[Part] | None = None
        if wake_first is True:
            wake = ALL_PARTS
        elif wake_first is not False:
            wake = _parts_from(wake_first)
        if wake is not None:
            t0 = time.time()
            self.wake_up(parts=wake)
            timeline.append((str(Transition(self._role, Action.WAKE_UP, wake)), t0, time.time()))
        t0 = time.time()
        out = work()
        timeline.append((label, t0, time.time()))
        if parts is not None:
            t0 = time.time()
            self.sleep(parts=parts)
            timeline.append((str(Transition(self._role, Action.SLEEP, parts)), t0, time.time()))
        return out

    def _require_awake(self, what: str, parts: frozenset[Part] = ALL_PARTS) -> None:
        """Refuse ``what`` while any of the ``parts`` it needs is asleep."""
        missing = parts & self._asleep_parts
        if missing:
            names = sorted(p.value for p in missing)
            raise RuntimeError(
                f"{self._name}.{what}() called while asleep ({names} asleep): the driver "
                f"must call wake_up(parts=...) with them first, or pass wake_first=True"
            )


def lifecycle_options(
    method: Callable[Concatenate[_W, _P], _R],
) -> Callable[Concatenate[_W, _P], _R]:
    """Give a worker method the keyword-only lifecycle options it declares:
    ``wake_first: bool | Iterable[Part] = False`` (``wake_up()`` before the work, of
    every part with ``True`` or of the given parts; idempotent) and
    ``sleep_after: Iterable[Part] | None = None`` (``sleep(parts=sleep_after)`` after the
    work succeeded; not when it raised). The wrapper consumes both (the method body
    never sees them) and records the call's timeline (``last_timeline()``)."""
    declared = inspect.signature(method).parameters
    for name in ("wake_first", "sleep_after"):
        if name not in declared or declared[name].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"{method.__qualname__} must declare the keyword-only {name!r}")

    @functools.wraps(method)
    def wrapper(self: _W, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        wake_first = cast("bool | Iterable[Part]", kwargs.pop("wake_first", False))
        sleep_after = cast("Iterable[Part] | None", kwargs.pop("sleep_after", None))
        return self._with_lifecycle(
            method.__name__,
            partial(method, self, *args, **kwargs),
            wake_first=wake_first,
            sleep_after=sleep_after,
        )

    return wrapper


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
        self.rank = rank
        self._name = "ActorWorker"
        self._role = Role.ACTOR
        self._offload_off = config.offload_backend == "none"
        self._timeline = []
        self._asleep_parts: frozenset[Part] = frozenset()
        self._frozen_asleep = False  # the reference model (actor with a KL loss)
        self._groups_live = True
        self._counters = {"policy_forward": 0, "policy_forward_backward": 0, "reference_forward": 0}
        self._backend = get_backend(config.backend)(
            config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
        )
        self._policy: TrainModel = self._backend.build_policy()
        self._reference: FrozenModel | None = (
            self._backend.build_reference() if config.use_reference else None
        )
        self.global_step = 0
        self._reset_step()
        self._drop_kept()

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

    def _drop_kept(self) -> None:
        """Forget the kept chunks (``train_chunk(keep=True)``) and their counts."""
        self._kept: list[dict[str, Tensor]] = []
        self._kept_counts = {"tokens": 0.0, "samples": 0.0, "rows": 0.0}

    def counters(self) -> dict[str, int]:
        """Samples (rows) that went through each pass since construction:
        ``policy_forward`` (no-grad log-prob forward: ``compute_logprobs``),
        ``policy_forward_backward`` (``train_chunk``), ``reference_forward``
        (``compute_ref_logprobs``, or inside ``train_chunk``). Rows of micro-batches
        skipped for having no valid token are not counted."""
        return dict(self._counters)

    def _split(self, tensors: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        return _micro_batches(
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
        _check_batch(batch, ("input_ids", "attention_mask"))
        mbs = self._split(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        )
        out = _cpu_cat(self._policy.forward(mbs, fn=_logprobs_fn))
        self._counters["policy_forward"] += _rows(mbs)
        return out

    def compute_ref_logprobs(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Log-probs of the frozen reference model (only with ``kl_loss_coef > 0``)."""
        self._require_awake("compute_ref_logprobs", FORWARD_PARTS)
        reference = self._require_reference()
        _check_batch(batch, ("input_ids", "attention_mask"))
        mbs = self._split(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        )
        out = _cpu_cat(reference.forward(mbs, fn=_logprobs_fn))
        self._counters["reference_forward"] += _rows(mbs)
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
        cfg = self.config
        _check_batch(
            batch,
            ("input_ids", "attention_mask", "loss_mask"),
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            engine_logprobs=engine_logprobs,
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
        mask = batch["loss_mask"].float()
        tokens = float(mask.sum().item())
        samples = float((mask.sum(dim=1) > 0).sum().item())
        metrics = {
            "actor/valid_tokens": tokens,
            "loss/pg": 0.0,
            "actor/clipfrac": 0.0,
            "actor/approx_kl": 0.0,
        }
        if cfg.use_reference:
            metrics["loss/kl"] = 0.0
        if cfg.entropy_coef > 0:
            metrics["loss/entropy"] = 0.0
        if engine_logprobs is not None:
            metrics["rollout/kl_engine_trainer_sum"] = 0.0
        if self._chunks == 0:
            self._drop_kept()  # a new step (an aborted one's chunks are stale)
        self._chunks += 1
        self._sums["rows"] += float(mask.shape[0])
        if keep:
            self._kept_counts["rows"] += float(mask.shape[0])
        if tokens == 0:
            return metrics
        tensors = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "loss_mask": mask,
            "advantages": advantages.float(),
        }
        if old_logprobs is not None:
            tensors["old_logprobs"] = old_logprobs.float()
        if cfg.use_reference and ref_logprobs is not None:
            tensors["ref_logprobs"] = ref_logprobs.float()
        if engine_logprobs is not None:
            tensors["engine_logprobs"] = engine_logprobs.double()
        mbs = [mb for mb in self._split(tensors) if bool(mb["loss_mask"].any())]
        if cfg.use_reference and ref_logprobs is None:
            reference = self._require_reference()
            for mb, ref in zip(mbs, reference.forward(mbs, fn=_logprobs_fn), strict=True):
                mb["ref_logprobs"] = ref
            self._counters["reference_forward"] += _rows(mbs)
        results = self._policy.forward_backward(
            mbs, loss_fn=partial(self._loss, denominator=self._denominator, keep=keep)
        )
        self._counters["policy_forward_backward"] += _rows(mbs)
        chunk = self._add_sums(results, tokens=tokens, samples=samples)
        if keep:  # the old log-probs were put into each micro-batch by _loss
            for mb in mbs:
                mb.pop("engine_logprobs", None)
                self._kept.append({k: v.to("cpu") for k, v in mb.items()})
            self._kept_counts["tokens"] += tokens
            self._kept_counts["samples"] += samples
        metrics["loss/pg"] = chunk["pg"]
        metrics["actor/clipfrac"] = chunk["clipfrac"] / tokens
        metrics["actor/approx_kl"] = chunk["approx_kl"] / tokens
        if cfg.use_reference:
            metrics["loss/kl"] = chunk["kl"]
        if cfg.entropy_coef > 0:
            metrics["loss/entropy"] = chunk["entropy"]
        if engine_logprobs is not None:
            metrics["rollout/kl_engine_trainer_sum"] = chunk["kl_engine"]
        return metrics

    def _add_sums(
        self, results: Sequence[Mapping[str, float]], *, tokens: float, samples: float
    ) -> dict[str, float]:
        """One pass's micro-batch results, summed, added to the step's sums."""
        summed = {k: sum(r[k] for r in results) for k in results[0]}
        self._sums["tokens"] += tokens
        self._sums["samples"] += samples
        for k in ("pg", "kl", "entropy", "clipfrac", "approx_kl"):
            self._sums[k] += summed[k]
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
        if not (isinstance(epochs, int) and epochs >= 1):
            raise ValueError(
                f"epochs={epochs!r} is invalid: pass the number of epochs after the first (>= 1)"
            )
        if self._chunks:
            raise ValueError(
                "train_epochs() with an open step: call finish_step() after the chunks first "
                "(epoch 1's update), then train_epochs() for the others"
            )
        (kept_rows,) = self._backend.all_reduce_sum([self._kept_counts["rows"]])
        if kept_rows == 0:
            raise ValueError(
                "train_epochs(): no chunk was kept on any rank; pass keep=True to every "
                "train_chunk() of the step"
            )
        out: dict[str, float] = {}
        try:
            for _ in range(epochs):
                self._denominator = float(loss_denominator)
                self._chunks = 1
                self._sums["rows"] += self._kept_counts["rows"]
                if self._kept:
                    mbs = [
                        {k: v.to(self._backend.device) for k, v in mb.items()} for mb in self._kept
                    ]
                    results = self._policy.forward_backward(
                        mbs, loss_fn=partial(self._loss, denominator=self._denominator, keep=False)
                    )
                    self._counters["policy_forward_backward"] += _rows(mbs)
                    counts = self._kept_counts
                    self._add_sums(results, tokens=counts["tokens"], samples=counts["samples"])
                out = self._finish(None)
        finally:
            self._drop_kept()
        return out

    def _loss(
        self, logits: Tensor, mb: Batch, denominator: float, keep: bool = False
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        mask = mb["loss_mask"]
        logprobs = _logprobs_fn(logits, mb)
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
            ent = _shift(entropy_from_logits(logits=logits))
            ent_loss = aggregate_loss(
                loss=ent, mask=mask, mode=cfg.loss_agg, denominator=denominator
            )
            loss = loss - cfg.entropy_coef * ent_loss
            out["entropy"] = float(ent_loss.item())
        if "engine_logprobs" in mb:
            # k3 of d = old - engine: kl_penalty's log_r = ref_logprobs - logprobs
            k3 = kl_penalty(
                logprobs=mb["engine_logprobs"],
                ref_logprobs=old.double(),
                estimator="k3",
                mask=mask,
            )
            out["kl_engine"] = float(masked_sum(values=k3, mask=mask.double()).item())
        return loss, out

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
        if loss_denominator is not None and not (
            isinstance(loss_denominator, int | float) and loss_denominator > 0
        ):
            raise ValueError(
                f"loss_denominator={loss_denominator!r} is invalid: pass the whole step's "
                "positive count, or None to keep the one given to train_chunk()"
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
        assert provisional is not None  # tokens > 0 implies a train_chunk call
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
            self._policy.scale_grads(scale)
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
        if self._chunks:
            raise RuntimeError(
                "save_checkpoint() in the middle of a step (train_chunk without finish_step); "
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
        self._drop_kept()


# --------------------------------------------------------------------------- critic


class CriticWorker(_Lifecycle):
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
        self.rank = rank
        self._name = "CriticWorker"
        self._role = Role.CRITIC
        self._offload_off = config.offload_backend == "none"
        self._timeline = []
        self._asleep_parts: frozenset[Part] = frozenset()
        self._frozen_asleep = False  # the reference model (actor with a KL loss)
        self._groups_live = True
        self._counters = {"value_forward": 0, "value_forward_backward": 0}
        self._backend = get_backend(config.backend)(
            config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
        )
        self._critic: TrainModel = self._backend.build_critic()
        self.global_step = 0

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
        _check_batch(batch, ("input_ids", "attention_mask"))
        mbs = _micro_batches(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
            size=self.config.micro_batch_size,
            device=self._backend.device,
        )
        out = _cpu_cat(self._critic.forward(mbs, fn=_values_fn))
        self._counters["value_forward"] += _rows(mbs)
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
                self._counters["value_forward_backward"] += _rows(mbs)
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
