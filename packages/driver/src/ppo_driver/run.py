"""``train()``: build everything a run needs, drive the pump, checkpoint, report.

The shell around :class:`ppo_driver.pump.TrainPump`: the Ray cluster (``_cluster``), the
shared placement (actor and critic on the same bundles, generation on its own), the
trainer workers (a :class:`ppo_driver.pair.TrainPair`), the engines (``_engines``), the
rollout manager, checkpoints (atomic, never pickled), metrics (console + JSONL), the
reward plot and the Chrome-trace timeline. Before anything starts: the run directory
and its lock (``_rundir``), the resume policy (``_resume``); during the run: signals
(``_signals``) and faults (``_faults``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from ppo_placement import SharedPlacement
from ppo_sampler import Sampler, make_sampler
from ppo_trainer import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ModelSpec,
)

from ppo_driver._cluster import _connect_cluster, _where
from ppo_driver._engines import _Generation, _launch_engines, _refit_backend
from ppo_driver._faults import (
    _REPORTED_ELSEWHERE,
    _TEARDOWN_WITHOUT_RAY,
    RunFailed,
    _fault,
    describe_fault,
)
from ppo_driver._latest import last_checkpoint_note
from ppo_driver._outputs import (
    _export_policy,
    _progress_bar,
    _setup_logging,
    _summary,
    _write_outputs,
)
from ppo_driver._resume import (
    RESUME_FIXED_KEYS,
    RESUME_INPUT_KEYS,
    Fingerprints,
    _check_resume_config,
    _checkpoint_to_resume,
    resume_config_changes,
    resume_inputs,
)
from ppo_driver._rundir import LOCK_FILE, RunLock, _claim_contents, _open_run_dir
from ppo_driver._signals import RunStopped, _Interrupt, _SignalGuard
from ppo_driver.checkpoint import (
    checkpoint_step,
    find_latest,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from ppo_driver.config import (
    DriverConfig,
    ValidConfig,
    cluster_layout,
    sampler_config,
    trainer_configs,
    validated,
)
from ppo_driver.metrics import (
    TENSORBOARD_DIR,
    MetricsWriter,
    format_step_line,
)
from ppo_driver.pair import TrainPair
from ppo_driver.pump import InjectedFailure, StepReport, TrainPump
from ppo_driver.rollout import (
    EngineRestarted,
    Evaluator,
    RolloutManager,
    SamplingParams,
    WeightRefitter,
)
from ppo_driver.startup import FAIL_ENV, FAIL_POINTS, StartupError, parse_fail_at
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import TrainGroup
from ppo_driver.workload import Workload, load_workload

__all__ = [
    "FAIL_ENV",
    "FAIL_POINTS",
    "LOCK_FILE",
    "RESUME_FIXED_KEYS",
    "RESUME_INPUT_KEYS",
    "RunFailed",
    "RunLock",
    "RunResult",
    "RunStopped",
    "StartupError",
    "describe_fault",
    "last_checkpoint_note",
    "parse_fail_at",
    "resume_config_changes",
    "resume_inputs",
    "train",
]

log = logging.getLogger("ppo_driver")

OnExit = Callable[[str, Callable[[], object]], None]
"""Registers a teardown step (what, how): run at the end, last registered first."""


@dataclass
class RunResult:
    run_dir: Path
    completed_steps: int
    reports: list[StepReport] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    resumed_from: int | None = None


def train(
    config: DriverConfig | ValidConfig,
    *,
    run_dir: str | Path,
    resume: bool = False,
    overwrite: bool = False,
    fail_at: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    keep_ray: bool = False,
) -> RunResult:
    """Run ``cfg.run.num_steps`` PPO steps (from the newest checkpoint with ``resume``).

    Before anything starts (no Ray, no workers), refused with :class:`StartupError`: a
    run directory that cannot be written, one another run holds (an exclusive lock for
    the life of the run), a non-empty one without ``resume`` or ``overwrite`` (which
    empties it), a damaged newest checkpoint or a config that changes the meaning of the
    saved state (``resume``), a malformed ``fail_at``.

    SIGINT and SIGTERM (main thread) stop the run cleanly: a checkpoint being written is
    completed, workers, engines and Ray are shut down, then :class:`RunStopped` is raised.

    ``fail_at="<step>:<point>"`` (or the ``PPO_DRIVER_FAIL_AT`` environment variable)
    raises :class:`~ppo_driver.pump.InjectedFailure` at a named point: ``after_chunks``,
    ``after_policy_update``, ``before_critic``, ``after_step`` or ``checkpoint``.
    ``keep_ray`` leaves the Ray cluster up (tests share one per module). A ``DriverConfig``
    is validated first (:class:`~ppo_driver.config.ConfigError` with every problem before
    anything starts): the Python API gets the CLI's refusals.
    """
    t_run = time.perf_counter()
    valid = validated(config)
    cfg = valid.config
    fail_at = parse_fail_at(fail_at if fail_at is not None else os.environ.get(FAIL_ENV))
    if resume and overwrite:
        raise StartupError("--resume and --overwrite exclude each other: choose one")
    run_dir = Path(run_dir)
    guard = _SignalGuard()
    guard.install()
    lock: RunLock | None = None
    # The driver's tensors are a step's rows (batch assembly, GAE, whitening): intra-op
    # threads buy nothing there, and their spinning takes cores the trainers and engines
    # share on a small machine (measured: assembling a 256-row step batch took 13 ms with
    # 2 threads while the workers ran, against 0.1 ms alone). Restored at the end.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _open_run_dir(run_dir)
        lock = RunLock.acquire(run_dir)
        removed = _claim_contents(run_dir, resume=resume, overwrite=overwrite)
        return _logged(
            cfg, run_dir=run_dir, resume=resume, removed=removed, guard=guard,
            run=lambda latest, inputs: _run(
                valid, run_dir=run_dir, inputs=inputs, latest=latest, fail_at=fail_at,
                on_step=on_step, keep_ray=keep_ray, guard=guard, t_run=t_run,
            ),
        )  # fmt: skip
    except BaseException as exc:
        if guard.received is None:
            raise
        latest = find_latest(run_dir / "checkpoints")
        raise RunStopped(guard.received, run_dir=run_dir, checkpoint=latest) from (
            None if isinstance(exc, _Interrupt) else exc
        )
    finally:
        torch.set_num_threads(threads)
        guard.restore()
        if lock is not None:
            lock.release()


def _logged(
    cfg: DriverConfig,
    *,
    run_dir: Path,
    resume: bool,
    removed: list[str],
    guard: _SignalGuard,
    run: Callable[[Path | None, Fingerprints], RunResult],
) -> RunResult:
    """The checkpoint to resume from (verified, its config compared), then ``run`` with
    ``train.log`` open; nothing to train when the checkpoint has every step done."""
    ckpt_dir = run_dir / "checkpoints"
    latest = _checkpoint_to_resume(ckpt_dir) if resume else None
    inputs = resume_inputs(cfg)
    if latest is not None:
        _check_resume_config(cfg, latest, run_dir, inputs)
    handler = _setup_logging(run_dir, cfg.run.log_level)
    try:
        done = checkpoint_step(latest) if latest is not None else None
        if done is not None and done >= cfg.run.num_steps:
            log.info(
                "--resume: %s has %d step(s) done, run.num_steps=%d: nothing to train "
                "(raise run.num_steps to continue)",
                latest,
                done,
                cfg.run.num_steps,
            )
            return RunResult(run_dir, completed_steps=done, resumed_from=done)
        if removed:
            log.info("--overwrite: removed %s from %s", ", ".join(removed), run_dir)
        if resume and latest is None:
            log.info("--resume: no complete checkpoint under %s; starting at step 0", ckpt_dir)
        return run(latest, inputs)
    finally:
        logging.getLogger("ppo_driver").removeHandler(handler)
        handler.close()


@dataclass
class _Built:
    """Everything a run drives, built in :func:`_build`."""

    pair: TrainPair
    engines: list[Any]
    generation: _Generation
    sampler: Sampler
    manager: RolloutManager
    trace: TraceRecorder
    pump: TrainPump
    evaluator: Evaluator | None = None  # rollout.eval_dataset_path, every run.eval_every steps
    policy_spec: ModelSpec | None = None  # what the HF export at the end describes
    inputs: Fingerprints = field(default_factory=dict)  # resume_inputs, saved each time
    doing: str = "starting the models"  # what the run is doing, for a fault's message


def _run(
    valid: ValidConfig,
    *,
    run_dir: Path,
    inputs: Fingerprints,
    latest: Path | None,
    fail_at: str | None,
    on_step: Callable[[StepReport], None] | None,
    keep_ray: bool,
    guard: _SignalGuard,
    t_run: float,
) -> RunResult:
    """Build (cluster, worker groups, engines, data) -> start the models one at a time
    (and resume) -> the step loop -> teardown (of whatever was built, however the run
    ends)."""
    cfg = valid.config
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    torch.manual_seed(cfg.run.seed)
    cleanup = ExitStack()  # teardown, last built first; each step runs even if one fails
    cluster_lost = threading.Event()  # then only the steps that need no Ray run

    def on_exit(what: str, fn: Callable[[], object]) -> None:
        def run() -> None:
            if cluster_lost.is_set() and what not in _TEARDOWN_WITHOUT_RAY:
                log.info("teardown: %s skipped: the Ray cluster is gone", what)
                return
            try:
                fn()
            except Exception as exc:  # teardown goes on: leave nothing behind
                log.warning("teardown: %s failed: %s", what, exc)

        cleanup.callback(run)

    built: _Built | None = None
    with cleanup:
        try:
            built = _build(cfg, run_dir=run_dir, fail_at=fail_at, keep_ray=keep_ray,
                           on_exit=on_exit, workload=valid.workload)  # fmt: skip
            built.inputs = inputs
            guard.install()  # ray.init replaced the SIGTERM handler with its own
            resumed_from = _start(built, latest=latest, t_run=t_run)
            result = _loop(
                cfg, built, run_dir=run_dir, resumed_from=resumed_from, fail_at=fail_at,
                on_step=on_step, guard=guard, on_exit=on_exit,
            )  # fmt: skip
        except _REPORTED_ELSEWHERE:
            raise
        except Exception as exc:
            raise _fault(
                exc,
                built.pair if built is not None else None,
                step=built.pump.completed_steps if built is not None else 0,
                doing=built.doing if built is not None else "starting up",
                run_dir=run_dir,
                cluster_lost=cluster_lost,
            ) from exc
    result.wall_s = time.perf_counter() - t_run
    _summary(result.metrics, wall_s=result.wall_s, run_dir=run_dir)
    return result


def _build(
    cfg: DriverConfig,
    *,
    run_dir: Path,
    fail_at: str | None,
    keep_ray: bool,
    on_exit: OnExit,
    workload: Workload | None,
) -> _Built:
    """The cluster, the shared placement, the worker processes (models not built yet),
    the engines, the data (``workload``: the one validate loaded) and the pump."""
    t0 = time.perf_counter()
    if workload is None:  # before Ray: data, tokenizer and reward errors stop here
        workload = load_workload(cfg)
    layout = cluster_layout(cfg)
    gpu_devices = _connect_cluster(cfg, layout, keep_ray=keep_ray, on_exit=on_exit)
    log.info("start-up: Ray up after %.1f s", time.perf_counter() - t0)

    actor_cfg, critic_cfg = trainer_configs(cfg, vocab_size=workload.tokenizer.vocab_size)
    try:  # actor rank r and critic rank r: bundle r
        placement = SharedPlacement(layout, probe_gpu_ids=gpu_devices).create()
    except TimeoutError as exc:  # resources taken by others on a joined cluster
        raise StartupError(f"cluster: {exc}") from None
    on_exit("placement teardown", placement.teardown)
    trace = TraceRecorder(origin=t0)
    pair = _train_pair(cfg, placement, actor_cfg, critic_cfg, run_dir=run_dir, trace=trace,
                       on_exit=on_exit)  # fmt: skip
    log.info("start-up: placement: %s", _where(placement))
    engines = _launch_engines(cfg, actor_cfg.model, list(placement.rollout_view()), on_exit=on_exit)
    sender, peers = pair.refit_source()
    refitter = WeightRefitter(
        actor=sender,
        peers=peers,
        engines=engines,
        backend=_refit_backend(cfg),
        master_addr=placement.actor_view()[0].node_ip,  # the store listens on rank 0's node
    )
    generation = _Generation(engines, refitter)
    sampler = make_sampler(sampler_config(cfg))
    manager = _rollout_manager(cfg, workload, engines, sampler, refitter)
    on_exit("trace and reward plot", lambda: _write_outputs(cfg, run_dir, trace))
    pump = TrainPump(
        cfg,
        pair=pair,
        rollout=manager,
        generation=generation,
        sampler=sampler,
        pad_id=workload.tokenizer.pad_id,
        trace=trace,
        fail_at=fail_at,
        step_of=manager.buffer.step_of,
    )
    return _Built(
        pair, engines, generation, sampler, manager, trace, pump,
        evaluator=_evaluator(cfg, workload, engines), policy_spec=actor_cfg.model,
    )  # fmt: skip


def _train_pair(
    cfg: DriverConfig,
    placement: SharedPlacement,
    actor_cfg: ActorConfig,
    critic_cfg: CriticConfig,
    *,
    run_dir: Path,
    trace: TraceRecorder,
    on_exit: OnExit,
) -> TrainPair:
    """One worker process per rank of each model (the models are built by ``start``)."""
    log_file = (str((run_dir / "train.log").resolve()), cfg.run.log_level)
    actor = TrainGroup(
        "actor", ActorWorker, actor_cfg, slots=list(placement.actor_view()), log_file=log_file
    )
    on_exit("actor workers", actor.kill)
    critic = TrainGroup(
        "critic", CriticWorker, critic_cfg, slots=list(placement.critic_view()), log_file=log_file
    )
    on_exit("critic workers", critic.kill)
    return TrainPair(actor, critic, trace=trace)


def _rollout_manager(
    cfg: DriverConfig,
    workload: Workload,
    engines: list[Any],
    sampler: Sampler,
    refitter: WeightRefitter,
) -> RolloutManager:
    return RolloutManager(
        engines=engines,
        dataset=workload.dataset,
        sampler=sampler,
        reward_fn=workload.reward_fn,
        params=SamplingParams(
            n=cfg.ppo.num_generations_per_prompt,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=workload.stop_token_ids,
        ),
        prompts_per_step=cfg.batch_groups,
        max_in_flight=cfg.max_in_flight,
        groups_per_call=cfg.groups_per_call,
        on_engine_restart=refitter.restore_engine,
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        file_in_dispatch_order=cfg.fixed_chunks and cfg.block_order == "dispatch",
        file_by_length=cfg.fixed_chunks and cfg.block_order == "length",
        progress_interval_s=cfg.async_rl.poll_interval_s,
        max_consecutive_group_failures=cfg.rollout.max_consecutive_group_failures,
    )


def _evaluator(cfg: DriverConfig, workload: Workload, engines: list[Any]) -> Evaluator | None:
    """Greedy evaluation on ``rollout.eval_dataset_path``'s prompts (none without it)."""
    if workload.eval_dataset is None:
        return None
    return Evaluator(
        engines=engines,
        dataset=workload.eval_dataset,
        reward_fn=workload.reward_fn,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=workload.stop_token_ids,
        timeout_s=cfg.rollout.reward_timeout_s,
    )


def _start(built: _Built, *, latest: Path | None, t_run: float) -> int | None:
    """Start the models one at a time (``TrainPair.start``: two full models and
    optimizers never need to fit at once). Then restore every other stateful part from
    ``latest``; returns the step resumed from (``None``: a fresh run). Colocated, the
    engines have released their memory before the actor is built (they start released)."""
    if built.pump.cfg.cluster.colocate:
        with built.trace.span("start engines (released)", phase="startup"):
            ray.get([e.health.remote() for e in built.engines])
        log.info("start-up: %d engine(s) up, memory released", len(built.engines))
    built.pair.start(latest)
    ray.get([e.health.remote() for e in built.engines])
    log.info("start-up: worker processes: %s", "; ".join(built.pair.processes()))
    log.info(
        "start-up: critic built%s; %d engine(s) ready after %.1f s",
        " and loaded" if latest else "",
        len(built.engines),
        time.perf_counter() - t_run,
    )
    if latest is None:
        return None
    data = load_checkpoint(latest)
    state = data.state
    built.sampler.load_state_dict(state["sampler"])
    rollout_tensors = {
        k[len("rollout/") :]: v for k, v in data.tensors.items() if k.startswith("rollout/")
    }
    built.manager.load_state_dict(state["rollout"], rollout_tensors)
    restore_rng(state["rng"], data.tensors)
    built.pump.load_state_dict(state.get("pump", state))
    built.pump.restore_generation()  # the engines get the checkpoint's policy
    log.info(
        "resumed from %s: %d step(s) done, weight version %d",
        latest.name,
        built.pump.completed_steps,
        built.pump.weight_version,
    )
    return built.pump.completed_steps


def _checkpoint(
    cfg: DriverConfig, built: _Built, ckpt_dir: Path, *, step_done: int, fail_at: str | None
) -> None:
    """An atomic checkpoint after step ``step_done`` (never inside an update)."""
    pump = built.pump  # save_models refuses inside an update

    def write_models(tmp: Path) -> None:
        pump.save_models(tmp, step=step_done)

    def crash_hook(point: str) -> None:
        if fail_at == f"{step_done}:checkpoint" and point == "after_models":
            raise InjectedFailure(f"injected failure while writing checkpoint {step_done}")

    rollout_meta, rollout_tensors = built.manager.state_dict()
    rng_json, rng_tensors = rng_state()
    tensors = {**rng_tensors, **{f"rollout/{k}": v for k, v in rollout_tensors.items()}}
    with built.trace.span("checkpoint", step=step_done - 1, phase="checkpoint"):
        path = save_checkpoint(
            ckpt_dir,
            step_done,
            state={
                "completed_steps": pump.completed_steps,  # also in "pump" (older readers)
                "weight_version": pump.weight_version,
                "pump": pump.state_dict(),
                "sampler": built.sampler.state_dict(),
                "rollout": rollout_meta,
                "rng": rng_json,
                "config": cfg.to_dict(),
                "inputs": built.inputs,
            },
            tensors=tensors,
            write_models=write_models,
            keep=cfg.run.keep_checkpoints,
            crash_hook=crash_hook,
        )
    log.info("checkpoint %s", path)


def _evaluate(cfg: DriverConfig, built: _Built, *, step_done: int) -> dict[str, float]:
    """``eval/*`` metrics of the policy after step ``step_done``, when an evaluation is
    due (every ``run.eval_every`` steps, and after the last): greedy decoding of the
    held-out prompts on the engines, after the step's refit. An engine lost meanwhile
    skips it with a warning (the rollout manager re-dispatches training's groups)."""
    every, evaluator = cfg.run.eval_every, built.evaluator
    if evaluator is None or every < 1:
        return {}
    if step_done % every and step_done != cfg.run.num_steps:
        return {}
    with built.trace.span("eval", step=step_done - 1, phase="eval"):
        try:
            result = evaluator.run()
        except (ray.exceptions.RayActorError, EngineRestarted) as exc:
            log.warning("eval after step %d skipped: an engine was lost (%s)", step_done, exc)
            return {}
    metrics = result.metrics()
    log.info(
        "eval after step %d: reward mean %.4f over %d prompt(s), greedy (%d reward "
        "failure(s)), %.1f s",
        step_done,
        metrics["eval/reward_mean"],
        len(result.rewards),
        result.failures,
        result.seconds,
    )
    return metrics


def _loop(
    cfg: DriverConfig,
    built: _Built,
    *,
    run_dir: Path,
    resumed_from: int | None,
    fail_at: str | None,
    on_step: Callable[[StepReport], None] | None,
    guard: _SignalGuard,
    on_exit: OnExit,
) -> RunResult:
    """The step loop: one PPO step, its metrics line, a checkpoint when due; at the end
    the trained policy as a Hugging Face directory."""
    pump = built.pump
    metrics_writer = _metrics_writer(cfg, run_dir, resumed_from=resumed_from, pump=pump)
    on_exit("metrics file", metrics_writer.close)
    result = RunResult(
        run_dir=run_dir, completed_steps=pump.completed_steps, resumed_from=resumed_from
    )
    log.info(
        "ppo-driver: %s, %d prompts x %d samples per step, minimum %d groups, %d step(s) -> %s",
        (
            f"streaming (fixed blocks in {cfg.block_order} order)"
            if cfg.fixed_chunks
            else "streaming (chunks by arrival)"
        )
        if cfg.streaming
        else "full-batch",
        cfg.batch_groups,
        cfg.ppo.num_generations_per_prompt,
        cfg.min_groups,
        cfg.run.num_steps,
        run_dir,
    )
    while pump.completed_steps < cfg.run.num_steps:
        built.doing = f"training step {pump.completed_steps}"
        report = pump.run_step()
        _record(cfg, built, report, result, metrics_writer)
        if on_step is not None:
            on_step(report)
        every = cfg.run.checkpoint_every
        if (
            every and pump.completed_steps % every == 0
        ) or pump.completed_steps == cfg.run.num_steps:
            built.doing = f"writing checkpoint {pump.completed_steps} in {run_dir / 'checkpoints'}"
            with guard.deferred():  # a stop signal waits for the checkpoint to complete
                _checkpoint(
                    cfg, built, run_dir / "checkpoints", step_done=pump.completed_steps,
                    fail_at=fail_at,
                )  # fmt: skip
    if result.reports:  # the trained policy as a Hugging Face directory
        built.doing = f"exporting the policy to {run_dir / 'hf'}"
        with guard.deferred():
            assert built.policy_spec is not None
            _export_policy(cfg, built.pump, built.policy_spec, run_dir / "hf")
    return result


def _metrics_writer(
    cfg: DriverConfig, run_dir: Path, *, resumed_from: int | None, pump: TrainPump
) -> MetricsWriter:
    """``metrics.jsonl`` (a resumed run keeps the rows of the steps before it) and,
    with ``run.tensorboard``, TensorBoard event files."""
    writer = MetricsWriter(
        run_dir / "metrics.jsonl",
        keep_steps_below=pump.completed_steps if resumed_from is not None else None,
        tensorboard_dir=run_dir / TENSORBOARD_DIR if cfg.run.tensorboard else None,
    )
    if cfg.run.tensorboard:
        log.info(
            "TensorBoard event files in %s (view: tensorboard --logdir %s)",
            run_dir / TENSORBOARD_DIR,
            run_dir.parent,
        )
    return writer


def _record(
    cfg: DriverConfig,
    built: _Built,
    report: StepReport,
    result: RunResult,
    writer: MetricsWriter,
) -> None:
    """A finished step's metrics (with the refit's bytes and a due evaluation): written,
    kept in ``result``, and logged as one line."""
    pump, metrics = built.pump, report.metrics
    result.reports.append(report)
    if built.generation.last_refit is not None:
        metrics["perf/refit_bytes"] = built.generation.last_refit.bytes
    metrics.update(_evaluate(cfg, built, step_done=pump.completed_steps))
    writer.write(metrics)
    result.metrics.append(metrics)
    result.completed_steps = pump.completed_steps
    bar = _progress_bar(pump.completed_steps, cfg.run.num_steps) + " " if cfg.run.progress else ""
    log.info("%s%s", bar, format_step_line(metrics))
