"""The generation engines of a run (embedded or sglang) on the rollout bundles, and
:class:`Generation`, the engines as the pump's plan sees them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import ray
from ppo_placement import (
    Slot,
)
from ppo_trainer import ModelSpec

from ppo_driver.config import (
    DriverConfig,
)
from ppo_driver.rollout import (
    ActorRef,
    RefitStats,
    WeightRefitter,
    launch_embedded_engines,
    launch_sglang_engines,
)

log = logging.getLogger("ppo_driver")


def _refit_backend(cfg: DriverConfig) -> str:
    """The refit transport: NCCL for sglang engines on GPUs of their own (trainer rank 0
    and every engine on distinct GPUs), gloo otherwise (CPU engines, or sglang sharing
    the training GPUs: NCCL refuses two ranks on one GPU; the engine then copies the
    received tensors to its GPU)."""
    return "nccl" if cfg.rollout.engine == "sglang" and not cfg.cluster.colocate else "gloo"


CONTROL_THREADS = 8
"""Engine threads beyond the generate calls the rollout manager may have in flight: for
evaluation (two calls per engine) and the control calls (refit, pause, release, health),
which must never queue behind generation."""


def engine_concurrency(cfg: DriverConfig) -> int:
    """An engine's Ray ``max_concurrency``: every group the run may have in flight (all of
    them can land on one engine) gets a thread, so the engine batches them all into its
    rounds (a fixed 64 generated a batch of 128 groups in two rounds, twice the decode
    steps), plus :data:`CONTROL_THREADS`."""
    return cfg.max_in_flight + CONTROL_THREADS


def _launch_engines(
    cfg: DriverConfig,
    model: ModelSpec,
    slots: list[Slot],
    *,
    on_exit: Callable[[str, Callable[[], object]], None],
) -> list[ActorRef]:
    """``rollout.num_engines`` engines of kind ``rollout.engine`` on the rollout bundles
    (round robin; engines sharing a bundle split its share). sglang engines load the
    policy's directory, or write the tiny model of ``model`` on their node. Colocated,
    they start released and paused (the pump resumes them for generation)."""
    n = cfg.rollout.num_engines
    per_bundle = -(-n // len(slots))
    placed = [slots[i % len(slots)] for i in range(n)]
    strategies = [s.scheduling_strategy for s in placed]
    if cfg.rollout.engine == "sglang":
        engines = launch_sglang_engines(
            n,
            model=model,
            run_seed=cfg.run.seed,
            scheduling_strategies=strategies,
            num_cpus=placed[0].num_cpus,
            num_gpus=placed[0].num_gpus,  # validate: one rollout GPU per sglang engine
            engine_kwargs={
                "enable_memory_saver": cfg.cluster.colocate,
                **cfg.rollout.engine_kwargs,
            },
            released=cfg.cluster.colocate,
            max_concurrency=engine_concurrency(cfg),
        )
    else:
        engines = launch_embedded_engines(
            n,
            model=model,
            run_seed=cfg.run.seed,
            scheduling_strategies=strategies,
            num_cpus=placed[0].num_cpus / per_bundle,
            num_gpus=placed[0].num_gpus / per_bundle,
            step_delay_s=cfg.rollout.decode_delay_s,
            released=cfg.cluster.colocate,
            max_concurrency=engine_concurrency(cfg),
        )
    for engine in engines:
        on_exit("engine", partial(_kill, engine))
        if cfg.rollout.engine == "sglang":  # runs first: sglang stops its own processes
            on_exit("sglang engine shutdown", partial(_stop_sglang, engine))
    return engines


def _kill(engine: ActorRef) -> None:
    from ray.actor import ActorHandle

    assert isinstance(engine, ActorHandle), type(engine)  # what ray.kill takes
    ray.kill(engine)


def _stop_sglang(engine: ActorRef) -> None:
    ray.get(engine.shutdown.remote(), timeout=60)


class _Generation:
    """The engines as the pump's plan sees them: refit, pause/resume (shared devices:
    ``pause`` stops generation and releases the engines' memory, ``resume`` takes it back
    and generation goes on; both idempotent)."""

    def __init__(self, engines: list[ActorRef], refitter: WeightRefitter) -> None:
        self.engines, self.refitter = engines, refitter
        self.last_refit: RefitStats | None = None

    def refit(self, *, version: int) -> None:
        self.last_refit = self.refitter.refit(version=version)

    def pause(self) -> None:
        ray.get([e.pause_generation.remote() for e in self.engines])
        ray.get([e.release_memory.remote() for e in self.engines])

    def resume(self) -> None:
        ray.get([e.resume_memory.remote() for e in self.engines])
        ray.get([e.continue_generation.remote() for e in self.engines])
