"""``train()``: build everything a run needs, drive the pump, checkpoint, report.

The shell around :class:`ppo_driver.pump.TrainPump`: the local Ray cluster (through
``ppo_placement.start_local_ray``), the shared placement (actor and critic on the same
bundles, generation on its own), the trainer workers, the embedded engines, the rollout
manager, checkpoints (atomic, never pickled), metrics (console + JSONL), the reward
plot and the Chrome-trace timeline.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppo_driver.checkpoint import (
    find_latest,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from ppo_driver.config import DriverConfig, ModelConfig
from ppo_driver.metrics import MetricsWriter, format_step_line, plot_rewards, read_metrics
from ppo_driver.pump import InjectedFailure, StepReport, TrainPump
from ppo_driver.trace import TraceRecorder

__all__ = ["RunResult", "build_trainer_configs", "train"]

log = logging.getLogger("ppo_driver")

FAIL_ENV = "PPO_DRIVER_FAIL_AT"
"""``<step>:<point>`` makes the driver crash at a named point (tests, crash drills)."""

TASK_ALPHABET = "abcdefgh0123456789:"


@dataclass
class RunResult:
    run_dir: Path
    completed_steps: int
    reports: list[StepReport] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    resumed_from: int | None = None


# ------------------------------------------------------------------- config mapping


def _model_spec(m: ModelConfig, *, vocab_size: int, seed: int) -> Any:
    from ppo_trainer import ModelSpec

    return ModelSpec(
        path=m.model_path,
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        seed=seed,
    )


def build_trainer_configs(cfg: DriverConfig, *, vocab_size: int) -> tuple[Any, Any]:
    """The ``ActorConfig`` and ``CriticConfig`` of this run (the trainer's own types)."""
    from ppo_trainer import ActorConfig, CriticConfig

    ppo = cfg.ppo
    per_rank = max(1, cfg.samples_per_step // cfg.cluster.actor_gpus)

    def common(m: ModelConfig, seed: int) -> dict[str, Any]:
        mc = m.megatron_cfg
        options: dict[str, Any] = {}
        if mc.enabled:
            options = {
                "tensor_model_parallel_size": mc.tensor_model_parallel_size,
                "pipeline_model_parallel_size": mc.pipeline_model_parallel_size,
                "use_distributed_optimizer": mc.optimizer.use_distributed_optimizer,
                "overlap_param_gather": mc.optimizer.overlap_param_gather,
                "use_megatron_fsdp": mc.use_megatron_fsdp,
                "fp8_param": mc.fp8_param,
                "fp8_recipe": mc.fp8_recipe,
            }
        return {
            "model": _model_spec(m, vocab_size=vocab_size, seed=seed),
            "backend": "megatron" if mc.enabled else "torch",
            "backend_options": options,
            "device": "auto",
            "lr": m.lr,
            "weight_decay": m.weight_decay,
            "max_grad_norm": m.max_grad_norm,
            "warmup_steps": m.warmup_steps,
            "micro_batch_size": m.train_micro_batch_size or per_rank,
            "loss_agg": ppo.loss_agg,
        }

    actor = ActorConfig(
        **common(cfg.policy, cfg.run.seed),
        eps_clip=ppo.eps_clip,
        eps_clip_high=ppo.eps_clip_high,
        dual_clip=ppo.dual_clip,
        kl_loss_coef=ppo.kl_loss_coef,
        kl_estimator=ppo.kl_estimator,
        entropy_coef=ppo.entropy_coef,
    )
    critic = CriticConfig(**common(cfg.critic, cfg.run.seed + 1), value_clip=ppo.value_clip)
    return actor, critic


# ------------------------------------------------------------------- engines


class _Generation:
    """The engines as the pump's plan sees them: refit, pause/resume (shared devices)."""

    def __init__(self, engines: list[Any], refitter: Any) -> None:
        self.engines, self.refitter = engines, refitter
        self.last_refit: Any = None

    def refit(self, *, version: int) -> None:
        self.last_refit = self.refitter.refit(version=version)

    def pause(self) -> None:
        import ray

        ray.get([e.pause_generation.remote() for e in self.engines])
        ray.get([e.release_memory.remote() for e in self.engines])

    def resume(self) -> None:
        import ray

        ray.get([e.resume_memory.remote() for e in self.engines])
        ray.get([e.continue_generation.remote() for e in self.engines])


def _layout(cfg: DriverConfig) -> Any:
    """The bundle layout (critic reuses the actor's bundles; colocated: max of both)."""
    from ppo_placement import check_streaming_layout, placement_layout

    layout = placement_layout(
        actor_gpus=cfg.cluster.actor_gpus,
        rollout_gpus=cfg.cluster.rollout_gpus,
        colocate=cfg.cluster.colocate,
    )
    check_streaming_layout(layout, streaming=cfg.streaming)
    return layout


def _placement(layout: Any) -> Any:
    """The shared placement group: actor rank r and critic rank r on bundle r, the
    engines on the rollout bundles (or on the training bundles when colocated)."""
    from ppo_placement import SharedPlacement

    return SharedPlacement(layout).create()


# ------------------------------------------------------------------- logging / progress


def _setup_logging(run_dir: Path) -> logging.Handler:
    root = logging.getLogger("ppo_driver")
    root.setLevel(logging.INFO)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    if not any(getattr(h, "_ppo_console", False) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        console._ppo_console = True  # type: ignore[attr-defined]
        root.addHandler(console)
    return handler


def _progress_bar(done: int, total: int, *, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


# ------------------------------------------------------------------- the run


def train(
    cfg: DriverConfig,
    *,
    run_dir: str | Path,
    resume: bool = False,
    fail_at: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    keep_ray: bool = False,
) -> RunResult:
    """Run ``cfg.run.num_steps`` PPO steps (from the newest checkpoint with ``resume``).

    ``fail_at="<step>:<point>"`` (or the ``PPO_DRIVER_FAIL_AT`` environment variable)
    raises :class:`~ppo_driver.pump.InjectedFailure` at a named point: ``after_chunks``,
    ``after_policy_update``, ``before_critic``, ``after_step`` or ``checkpoint``.
    ``keep_ray`` leaves the Ray cluster up (tests share one per module).
    """
    import ray
    import torch
    from ppo_placement import start_local_ray
    from ppo_sampler import SamplerConfig, make_sampler
    from ppo_trainer import ActorWorker, CriticWorker, gae, masked_whiten

    from ppo_driver.rollout import (
        CharTokenizer,
        PromptDataset,
        RolloutManager,
        SamplingParams,
        WeightRefitter,
        launch_embedded_engines,
        load_reward_fn,
        repeat_reward,
        synthetic_records,
    )

    t_run = time.perf_counter()
    fail_at = fail_at or os.environ.get(FAIL_ENV) or None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = _setup_logging(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    latest = find_latest(ckpt_dir) if resume else None
    if resume and latest is None:
        log.info("--resume: no complete checkpoint under %s; starting from step 0", ckpt_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    torch.manual_seed(cfg.run.seed)

    # ---- cluster, placement, workers, engines
    started_here = not ray.is_initialized()
    layout = _layout(cfg)
    start_local_ray(
        num_gpus=layout.num_gpus,
        num_cpus=cfg.cluster.num_cpus
        or max(4, cfg.cluster.actor_gpus * 2 + cfg.rollout.num_engines),
    )
    from ppo_driver.workers import TrainGroup

    log.info("start-up: Ray up after %.1f s", time.perf_counter() - t_run)

    tokenizer = CharTokenizer(TASK_ALPHABET)
    actor_cfg, critic_cfg = build_trainer_configs(cfg, vocab_size=tokenizer.vocab_size)
    placement = _placement(layout)
    actor = TrainGroup("actor", ActorWorker, actor_cfg, slots=list(placement.actor_view()))
    critic = TrainGroup("critic", CriticWorker, critic_cfg, slots=list(placement.critic_view()))
    rollout_slots = list(placement.rollout_view())
    engine_slots = [rollout_slots[i % len(rollout_slots)] for i in range(cfg.rollout.num_engines)]
    engines = launch_embedded_engines(
        cfg.rollout.num_engines,
        model=actor_cfg.model,
        run_seed=cfg.run.seed,
        scheduling_strategies=[s.scheduling_strategy for s in engine_slots],
        num_cpus=engine_slots[0].num_cpus,
        num_gpus=engine_slots[0].num_gpus,
        step_delay_s=cfg.rollout.decode_delay_s,
    )
    actor.ready()
    critic.ready()
    ray.get([e.health.remote() for e in engines])
    log.info(
        "start-up: workers and %d engine(s) ready after %.1f s",
        len(engines),
        time.perf_counter() - t_run,
    )
    refitter = WeightRefitter(actor=actor.handles[0], engines=engines)
    generation = _Generation(engines, refitter)

    sampler = make_sampler(
        SamplerConfig(
            num_prompts_per_step=cfg.batch_groups,
            min_groups_for_streaming_train=cfg.min_groups,
            name=cfg.async_rl.sampler.name,
            max_lookahead_versions=cfg.async_rl.sampler.max_lookahead_versions,
            max_staleness_versions=cfg.async_rl.sampler.max_staleness_versions,
            evict_stale=cfg.async_rl.sampler.evict_stale,
        )
    )
    records = synthetic_records(
        num_prompts=4096, seed=cfg.run.seed, max_count=int(cfg.rollout.extra.get("max_count", 8))
    )
    dataset = PromptDataset(records, tokenizer)
    reward_fn = load_reward_fn(cfg.rollout.reward) if cfg.rollout.reward else repeat_reward
    lookahead = cfg.async_rl.sampler.max_lookahead_versions
    manager = RolloutManager(
        engines=engines,
        dataset=dataset,
        sampler=sampler,
        reward_fn=reward_fn,
        params=SamplingParams(
            n=cfg.ppo.num_generations_per_prompt,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=(tokenizer.eos_id,),
        ),
        prompts_per_step=cfg.batch_groups,
        max_in_flight=cfg.async_rl.max_prompts_in_flight or cfg.batch_groups * (1 + lookahead),
        groups_per_call=1,
    )
    from ppo_sampler import group_alignment

    alignment = group_alignment(
        generations_per_prompt=cfg.ppo.num_generations_per_prompt,
        actor_dp=cfg.cluster.actor_gpus,
        critic_dp=cfg.cluster.actor_gpus,
        actor_micro_batch=cfg.policy.train_micro_batch_size,
        critic_micro_batch=cfg.critic.train_micro_batch_size,
    )
    trace = TraceRecorder(origin=t_run)
    pump = TrainPump(
        cfg,
        actor=actor,
        critic=critic,
        rollout=manager,
        generation=generation,
        sampler=sampler,
        alignment=alignment,
        pad_id=tokenizer.pad_id,
        trace=trace,
        gae=gae,
        whiten=masked_whiten,
        fail_at=fail_at,
        step_of=manager.buffer.step_of,
    )

    # ---- resume
    resumed_from: int | None = None
    if latest is not None:
        data = load_checkpoint(latest)
        actor.call("load_checkpoint", str(latest / "actor"))
        critic.call("load_checkpoint", str(latest / "critic"))
        state = data.state
        sampler.load_state_dict(state["sampler"])
        rollout_tensors = {
            k[len("rollout/") :]: v for k, v in data.tensors.items() if k.startswith("rollout/")
        }
        manager.load_state_dict(state["rollout"], rollout_tensors)
        restore_rng(state["rng"], data.tensors)
        pump.completed_steps = int(state["completed_steps"])
        pump.weight_version = int(state["weight_version"])
        resumed_from = pump.completed_steps
        if pump.weight_version > 0:
            generation.refit(version=pump.weight_version)  # engines get the checkpoint's policy
        log.info(
            "resumed from %s: %d step(s) done, weight version %d",
            latest.name,
            pump.completed_steps,
            pump.weight_version,
        )
    pump.residency.start()

    metrics_writer = MetricsWriter(
        run_dir / "metrics.jsonl", keep_steps_below=pump.completed_steps if resume else None
    )
    result = RunResult(
        run_dir=run_dir, completed_steps=pump.completed_steps, resumed_from=resumed_from
    )
    mode = "streaming" if cfg.streaming else "full-batch"
    log.info(
        "ppo-driver: %s, %d prompts x %d samples per step, minimum %d groups, %d step(s) -> %s",
        mode,
        cfg.batch_groups,
        cfg.ppo.num_generations_per_prompt,
        cfg.min_groups,
        cfg.run.num_steps,
        run_dir,
    )

    def checkpoint(step_done: int) -> None:
        if pump.in_update:  # pragma: no cover - the loop only calls between steps
            raise RuntimeError("checkpoint requested inside an update")

        def write_models(tmp: Path) -> None:
            pump.residency.save_both(
                lambda role: (actor if role == "actor" else critic).call(
                    "save_checkpoint", str(tmp / role)
                ),
                step=step_done,
            )

        def crash_hook(point: str) -> None:
            if fail_at == f"{step_done}:checkpoint" and point == "after_models":
                raise InjectedFailure(f"injected failure while writing checkpoint {step_done}")

        rollout_meta, rollout_tensors = manager.state_dict()
        rng_json, rng_tensors = rng_state()
        tensors = {**rng_tensors, **{f"rollout/{k}": v for k, v in rollout_tensors.items()}}
        with trace.span("checkpoint", step=step_done - 1, phase="checkpoint"):
            path = save_checkpoint(
                ckpt_dir,
                step_done,
                state={
                    "completed_steps": pump.completed_steps,
                    "weight_version": pump.weight_version,
                    "sampler": sampler.state_dict(),
                    "rollout": rollout_meta,
                    "rng": rng_json,
                    "config": cfg.to_dict(),
                },
                tensors=tensors,
                write_models=write_models,
                keep=cfg.run.keep_checkpoints,
                crash_hook=crash_hook,
            )
        log.info("checkpoint %s", path)

    try:
        while pump.completed_steps < cfg.run.num_steps:
            report = pump.run_step()
            result.reports.append(report)
            metrics = report.metrics
            if generation.last_refit is not None:
                metrics["perf/refit_bytes"] = generation.last_refit.bytes
            metrics_writer.write(metrics)
            result.metrics.append(metrics)
            result.completed_steps = pump.completed_steps
            prefix = (
                _progress_bar(pump.completed_steps, cfg.run.num_steps) + " "
                if cfg.run.progress
                else ""
            )
            log.info("%s%s", prefix, format_step_line(metrics))
            if on_step is not None:
                on_step(report)
            every = cfg.run.checkpoint_every
            if (
                every and pump.completed_steps % every == 0
            ) or pump.completed_steps == cfg.run.num_steps:
                checkpoint(pump.completed_steps)
    finally:
        metrics_writer.close()
        trace.write(run_dir / "trace.json")
        rows = (
            read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        )
        if rows:
            plot_rewards(
                rows, run_dir / "reward.png", title=f"{cfg.run.name}: mean reward ({mode})"
            )
        for group in (actor, critic):
            group.kill()
        for engine in engines:
            ray.kill(engine)
        placement.teardown()
        if started_here and not keep_ray:
            ray.shutdown()
        logging.getLogger("ppo_driver").removeHandler(handler)
        handler.close()
    result.wall_s = time.perf_counter() - t_run
    _summary(result, cfg)
    return result


def _summary(result: RunResult, cfg: DriverConfig) -> None:
    rows = result.metrics
    if not rows:
        return
    chunks = [int(r["train/chunks"]) for r in rows]
    first, last = rows[0]["rollout/reward_mean"], rows[-1]["rollout/reward_mean"]
    k = max(1, min(10, len(rows) // 4))
    head = sum(r["rollout/reward_mean"] for r in rows[:k]) / k
    tail = sum(r["rollout/reward_mean"] for r in rows[-k:]) / k
    log.info(
        "done: %d step(s) in %.1f s | chunks per step: %s (mean %.2f) | mean reward %.3f -> %.3f "
        "(first %d vs last %d steps: %.3f -> %.3f) | %s",
        len(rows),
        result.wall_s,
        ", ".join(f"{c} chunk(s) x {n} step(s)" for c, n in sorted(Counter(chunks).items())),
        sum(chunks) / len(chunks),
        first,
        last,
        k,
        k,
        head,
        tail,
        result.run_dir,
    )
    log.info(
        "outputs: metrics.jsonl, reward.png, trace.json (open in https://ui.perfetto.dev), train.log, checkpoints/"
    )
