"""Actor and critic workers: the PPO mechanism the driver drives, one instance per rank.

The driver owns the plan (when to sleep, when to save, chunk boundaries, the step's
loss denominator); the workers own the mechanism. Every method works on CPU tensors
in and out (``[B, T]``, shifted layout of docs/interfaces.md); the backend moves them
to its device. Model memory is moved only by ``sleep`` / ``wake_up`` (idempotent), which
the driver calls directly or asks for around one call with the lifecycle options
``wake_first`` / ``sleep_after`` (one Ray round trip per model per chunk).

This module gathers the workers' names; each lives with its concern:

- :mod:`._worker_base`: what both workers share (backend, sleep/wake_up, the lifecycle
  options and their timeline, checkpoint files), ``EmptyStepError``, ``Timeline``;
- :mod:`._actor`: ``ActorWorker``; its step bookkeeping in :mod:`._actor_step`, its loss
  in :mod:`._actor_loss`, the chunks it keeps for later epochs in :mod:`._kept_chunks`;
- :mod:`._critic`: ``CriticWorker``;
- :mod:`._batching`: batch checks, micro-batching, the shifted layout, ``loss_denominator``.
"""

from __future__ import annotations

from ppo_trainer._actor import ActorWorker
from ppo_trainer._batching import loss_denominator
from ppo_trainer._critic import CriticWorker
from ppo_trainer._worker_base import EmptyStepError, Timeline, lifecycle_options

__all__ = [
    "ActorWorker",
    "CriticWorker",
    "EmptyStepError",
    "Timeline",
    "lifecycle_options",
    "loss_denominator",
]
