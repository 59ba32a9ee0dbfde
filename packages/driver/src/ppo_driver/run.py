"""``train()``: build everything a run needs, drive the pump, checkpoint, report.

The shell around :class:`ppo_driver.pump.TrainPump`: the local Ray cluster (through
``ppo_placement.start_local_ray``), the shared placement (actor and critic on the same
bundles, generation on its own), the trainer workers, the embedded engines, the rollout
manager, checkpoints (atomic, never pickled), metrics (console + JSONL), the reward
plot and the Chrome-trace timeline.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from ppo_lifecycle import ALL_PARTS, Role
from ppo_placement import (
    Layout,
    RayJoinError,
    RoleView,
    SharedPlacement,
    Slot,
    join_ray,
    start_local_ray,
)
from ppo_sampler import Sampler, make_sampler
from ppo_trainer import ActorWorker, CriticWorker, ModelSpec, save_hf_checkpoint
from transformers import AutoTokenizer

from ppo_driver._latest import last_checkpoint_note
from ppo_driver.checkpoint import (
    CheckpointDamaged,
    checkpoint_step,
    complete_checkpoints,
    find_latest,
    input_fingerprint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from ppo_driver.config import (
    DriverConfig,
    ValidConfig,
    cluster_layout,
    cuda_device_count,
    local_num_cpus,
    model_path,
    sampler_config,
    trainer_configs,
    validated,
)
from ppo_driver.metrics import (
    TENSORBOARD_DIR,
    MetricsWriter,
    format_step_line,
    plot_rewards,
    read_metrics,
)
from ppo_driver.pump import InjectedFailure, NonFiniteError, StepReport, TrainPump
from ppo_driver.rollout import (
    ClusterLost,
    EngineRestarted,
    Evaluator,
    RefitStats,
    RewardFailure,
    RolloutManager,
    SamplingParams,
    WeightRefitter,
    cluster_reachable,
    gcs_address,
    launch_embedded_engines,
    launch_sglang_engines,
)
from ppo_driver.startup import FAIL_ENV, FAIL_POINTS, StartupError, parse_fail_at
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import LogFile, TrainGroup
from ppo_driver.workload import load_workload

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

LOCK_FILE = "run.lock"
"""In the run directory: locked (``flock``) by the run using it; names its holder."""

RESUME_FIXED_KEYS: tuple[str, ...] = (
    "run.seed",  # prompt order, sampling and initial weights
    "ppo.num_prompts_per_step",  # which prompts make step k; replay and sampler state
    "ppo.num_generations_per_prompt",  # rows per group in the replay buffer
    "cluster.actor_gpus",  # data-parallel ranks: one checkpoint file set per rank
    "rollout.dataset_path",  # the prompts (null: the built-in task)
    "rollout.prompt_key",  # the prompt of record i
    "rollout.apply_chat_template",  # the token ids of prompt i
    "rollout.extra",  # e.g. the built-in task's max_count: what prompt i is
    "async_rl.sampler.name",  # the sampler state's format
    *(
        f"{role}.{key}"
        for role in ("policy", "critic")
        for key in (
            "model_path",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "megatron_cfg.enabled",
            "megatron_cfg.tensor_model_parallel_size",
            "megatron_cfg.pipeline_model_parallel_size",
            "megatron_cfg.optimizer.use_distributed_optimizer",
        )
    ),
)
"""Config keys that fix the meaning of a run's saved state: ``--resume`` refuses to
change them (the rest, e.g. ``run.num_steps`` or learning rates, may change)."""

RESUME_INPUT_KEYS: tuple[str, ...] = (
    "rollout.dataset_path",
    "policy.model_path",
    "critic.model_path",
)
"""The :data:`RESUME_FIXED_KEYS` that name files: checkpoints record what they point
at (:func:`ppo_driver.checkpoint.input_fingerprint`), and ``--resume`` compares that,
not the path as written (the same files under another path are the same input)."""


def resume_inputs(cfg: DriverConfig) -> dict[str, dict[str, str] | None]:
    """The fingerprint of each :data:`RESUME_INPUT_KEYS` input of ``cfg`` (a null
    ``critic.model_path``: the policy's directory, which the critic is built from)."""
    return {
        "rollout.dataset_path": input_fingerprint(cfg.rollout.dataset_path),
        "policy.model_path": input_fingerprint(model_path(cfg, "policy")),
        "critic.model_path": input_fingerprint(model_path(cfg, "critic")),
    }


class RunStopped(BaseException):
    """``train`` stopped on SIGINT or SIGTERM after a clean teardown (workers, engines and
    Ray shut down, no checkpoint half-written). Like ``KeyboardInterrupt``, not an
    ``Exception``. ``exit_code``: 128 + the signal number (130, 143)."""

    def __init__(self, signum: int, *, run_dir: Path, checkpoint: Path | None) -> None:
        self.signum, self.run_dir, self.checkpoint = signum, run_dir, checkpoint
        super().__init__(f"stopped by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class RunFailed(RuntimeError):
    """``train`` stopped on a fault during the run (a worker or engine process that
    died, a lost Ray cluster, an I/O error writing a checkpoint or the export, a
    worker's exception), after the same teardown as any other end: workers, engines and
    Ray shut down, nothing half-written left. The cause is ``__cause__``, its traceback
    is in ``train.log``. ``step``: steps completed when it happened; ``what``: the fault
    in one line (:func:`describe_fault`), with what the run was doing."""

    def __init__(self, *, step: int, what: str, run_dir: Path) -> None:
        self.step, self.what, self.run_dir = step, what, run_dir
        ckpt_dir = run_dir / "checkpoints"
        self.checkpoint = find_latest(ckpt_dir) if ckpt_dir.is_dir() else None
        self.cluster_lost = False  # the Ray cluster is gone (Ray calls would block)
        super().__init__(f"stopped at step {step}: {what}")


@dataclass
class RunResult:
    run_dir: Path
    completed_steps: int
    reports: list[StepReport] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    resumed_from: int | None = None


# ------------------------------------------------------------------- engines


def _refit_backend(cfg: DriverConfig) -> str:
    """The refit transport: NCCL for sglang engines on GPUs of their own (trainer rank 0
    and every engine on distinct GPUs), gloo otherwise (CPU engines, or sglang sharing
    the training GPUs: NCCL refuses two ranks on one GPU; the engine then copies the
    received tensors to its GPU)."""
    return "nccl" if cfg.rollout.engine == "sglang" and not cfg.cluster.colocate else "gloo"


def _launch_engines(
    cfg: DriverConfig,
    model: ModelSpec,
    slots: list[Slot],
    *,
    on_exit: Callable[[str, Callable[[], object]], None],
) -> list[Any]:
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
        )
    for engine in engines:
        on_exit("engine", partial(ray.kill, engine))
        if cfg.rollout.engine == "sglang":  # runs first: sglang stops its own processes
            on_exit("sglang engine shutdown", partial(_stop_sglang, engine))
    return engines


def _stop_sglang(engine: Any) -> None:
    ray.get(engine.shutdown.remote(), timeout=60)


class _Generation:
    """The engines as the pump's plan sees them: refit, pause/resume (shared devices:
    ``pause`` stops generation and releases the engines' memory, ``resume`` takes it back
    and generation goes on; both idempotent)."""

    def __init__(self, engines: list[Any], refitter: WeightRefitter) -> None:
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


# ------------------------------------------------------------------- cluster


def _connect_cluster(
    cfg: DriverConfig,
    layout: Layout,
    *,
    keep_ray: bool,
    on_exit: Callable[[str, Callable[[], object]], None],
) -> None:
    """``cluster.address`` null: start a local Ray cluster with the layout's (logical)
    GPUs, shut down at the end. Else join the existing cluster there; at the end the
    driver only disconnects (``ray.shutdown()`` in a joined driver stops nothing of the
    cluster): it never tears down a cluster it did not start."""
    started_here = not ray.is_initialized()
    address = cfg.cluster.address
    if address is None:
        if started_here and not keep_ray:
            on_exit("ray.shutdown", ray.shutdown)
        start_local_ray(
            num_gpus=layout.num_gpus if cfg.cluster.logical_gpus else cuda_device_count(),
            num_cpus=local_num_cpus(cfg, layout),
        )
        return
    try:
        joined = join_ray(address)
    except (ValueError, RayJoinError) as exc:
        raise StartupError(f"cluster.address={address}: {exc}") from None
    if started_here and not keep_ray:
        on_exit("leaving the Ray cluster (it keeps running)", ray.shutdown)
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    gpus, cpus = float(total.get("GPU", 0.0)), float(total.get("CPU", 0.0))
    if gpus < layout.num_gpus or cpus < layout.num_gpus:
        raise StartupError(
            f"cluster.address={address}: the cluster has {gpus:g} GPU(s) and {cpus:g} CPU(s) "
            f"on {len(nodes)} node(s), but this run reserves {layout.num_gpus} bundles of 1 GPU "
            f"+ 1 CPU (cluster.actor_gpus={cfg.cluster.actor_gpus} for actor and critic, "
            f"cluster.rollout_gpus={cfg.cluster.rollout_gpus}"
            f"{', colocated' if layout.colocate else ''}); add nodes or GPUs (`ray start "
            "--num-gpus=N`), or ask for fewer"
        )
    log.info(
        "start-up: joined the Ray cluster at %s (%d node(s), %g GPU(s), %g CPU(s)); it stays "
        "up after the run",
        joined.address,
        len(nodes),
        gpus,
        cpus,
    )


def _where(placement: SharedPlacement) -> str:
    """Which nodes hold the training ranks and the engines (for the start-up log)."""

    def nodes(view: RoleView) -> str:
        seen: dict[str, str] = {}
        for slot in view:
            seen.setdefault(slot.node_id, slot.node_ip)
        return ", ".join(f"{ip} (node {node_id[:12]})" for node_id, ip in seen.items())

    return (
        f"actor and critic ranks on {nodes(placement.actor_view())}; engines on "
        f"{nodes(placement.rollout_view())}"
    )


# ------------------------------------------------------------------- logging / progress


_FILE_ONLY = {"ppo_file_only": True}
"""``extra=`` of a log record for ``train.log`` only (a fault's traceback): the terminal
gets the one-line ``ppo-driver:`` message instead."""


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "ppo_file_only", False)


def _setup_logging(run_dir: Path, level: str = "INFO") -> logging.Handler:
    root = logging.getLogger("ppo_driver")
    root.setLevel(level)
    handler = LogFile(str(run_dir / "train.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    if not any(getattr(h, "_ppo_console", False) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        console.addFilter(_not_file_only)
        console._ppo_console = True  # type: ignore[attr-defined]
        root.addHandler(console)
    return handler


def _progress_bar(done: int, total: int, *, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


# ------------------------------------------------------------------- before anything starts


def _open_run_dir(run_dir: Path) -> None:
    """Create the run directory and prove it writable, or refuse with the reason."""
    if run_dir.exists() and not run_dir.is_dir():
        raise StartupError(f"--run-dir {run_dir} is a file, not a directory; choose another path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(
            f"--run-dir {run_dir} cannot be used: {exc.strerror or exc} "
            f"({type(exc).__name__}: {exc.filename or run_dir}); choose a directory you can "
            "create and write to"
        ) from None


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/run.lock`` held for the life of a run.

    The file names the holder (pid, host, start time, command) for the run that finds
    it taken. The kernel drops the lock when the holder's process ends, however it ends
    (the descriptor is not inherited by Ray's processes); the file itself stays.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        path = run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StartupError(f"cannot create the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise StartupError(
                f"run directory {run_dir} is in use by another run ({holder}; lock file "
                f"{path}); wait for that run to end or stop it, or choose another --run-dir"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock
            self._fd = None


def _lock_holder(fd: int) -> str:
    """The holder as its lock file describes it (it writes that right after locking)."""
    for _ in range(20):
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0) or b"null")
        except ValueError:
            info = None
        if isinstance(info, dict):
            return (
                f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
                f"{info.get('command')}"
            )
        time.sleep(0.05)
    return "holder not recorded yet"


_RUN_FILES = frozenset({"config.yaml", "train.log", "metrics.jsonl", "checkpoints"})


def _failed_start(run_dir: Path, names: Sequence[str]) -> bool:
    """Only what a run that stopped before finishing a step leaves behind (its config,
    its log, an empty metrics file or checkpoint folder): nothing a new run could lose."""
    if not set(names) <= _RUN_FILES | {"trace.json"}:
        return False
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    if metrics.exists() and (not metrics.is_file() or metrics.stat().st_size > 0):
        return False
    return not ckpts.exists() or (ckpts.is_dir() and not any(ckpts.iterdir()))


def _claim_contents(run_dir: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """A fresh run needs an empty run directory (``--overwrite`` empties it; returns what
    it removed). ``--resume`` continues what is there. A directory a failed start-up left
    (no step finished) is reused as it is: the new ``config.yaml`` replaces the old one
    and ``train.log`` goes on after the failed attempt's lines."""
    others = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if not others or resume or (not overwrite and _failed_start(run_dir, others)):
        return []
    if overwrite:
        if not set(others) & _RUN_FILES:  # a typo must not empty an unrelated directory
            raise StartupError(
                f"--overwrite: {run_dir} does not look like a ppo-driver run directory (none "
                f"of {', '.join(sorted(_RUN_FILES))}); not deleting its contents. Choose "
                "another --run-dir, or empty it yourself"
            )
        for name in others:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        return others
    shown = ", ".join(others[:6]) + (", ..." if len(others) > 6 else "")
    raise StartupError(
        f"run directory {run_dir} is not empty ({shown}). A new run there would mix with "
        "the old run's files, and checkpoint pruning (which keeps the highest step numbers) "
        "would delete the new run's own checkpoints. Continue the old run with --resume, "
        "start over with --overwrite (deletes the directory's contents), or choose another "
        "--run-dir"
    )


def _checkpoint_to_resume(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, verified (manifest) before anything reads it."""
    latest = find_latest(ckpt_dir)
    if latest is None:
        return None
    try:
        if not verify_checkpoint(latest):
            log.warning(
                "%s has no manifest (written before ppo-driver checked checkpoints): its "
                "files parse and have the lengths their headers give, contents not verified",
                latest,
            )
    except CheckpointDamaged as exc:
        raise StartupError(_damaged_message(exc, ckpt_dir)) from None
    return latest


def _damaged_message(exc: CheckpointDamaged, ckpt_dir: Path) -> str:
    damaged_step = checkpoint_step(exc.checkpoint) or 0
    fallback: Path | None = None
    for older in reversed(complete_checkpoints(ckpt_dir)):
        if (checkpoint_step(older) or 0) < damaged_step:
            try:
                verify_checkpoint(older)
            except CheckpointDamaged:
                continue
            fallback = older
            break
    out = f"--resume: {exc}. "
    if fallback is None:
        return out + (
            "No older complete checkpoint verifies: start over with --overwrite (deletes the "
            "run directory's contents) or choose another --run-dir"
        )
    return out + (
        f"The newest older checkpoint that verifies is {fallback} ({checkpoint_step(fallback)} "
        f"step(s) done). To continue from it, move {exc.checkpoint.name} out of {ckpt_dir} "
        "(or delete it) and run again with --resume; the steps after it are trained again"
    )


_MISSING = object()


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _digest(fingerprint: Any) -> str | None:
    return fingerprint.get("sha256") if isinstance(fingerprint, dict) else None


def resume_config_changes(
    saved: dict[str, Any],
    now: dict[str, Any],
    *,
    saved_inputs: Mapping[str, Any] | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> list[str]:
    """``"key: old (saved) -> new (now)"`` for each :data:`RESUME_FIXED_KEYS` entry that
    differs (keys the saved config does not have are skipped). With the fingerprints of
    both (``saved_inputs`` from the checkpoint, ``inputs`` now), the
    :data:`RESUME_INPUT_KEYS` compare what the paths point at, not how they are written."""
    out = []
    compared = saved_inputs is not None and inputs is not None
    if saved_inputs is not None and inputs is not None:
        for key in RESUME_INPUT_KEYS:
            old, new = saved_inputs.get(key, _MISSING), inputs.get(key)
            if old is _MISSING or _digest(old) == _digest(new):
                continue
            where = [
                "(none)" if fp is None else f"{fp['path']} (sha256 {fp['sha256'][:12]})"
                for fp in (old, new)
            ]
            out.append(f"{key}: {where[0]} (saved) -> {where[1]} (now): not the same input")
    for key in RESUME_FIXED_KEYS:
        if compared and key in RESUME_INPUT_KEYS:
            continue
        old, new = _dotted(saved, key), _dotted(now, key)
        if old is not _MISSING and old != new:
            shown = "(absent)" if new is _MISSING else repr(new)
            out.append(f"{key}: {old!r} (saved) -> {shown} (now)")
    return out


def _check_resume_config(
    cfg: DriverConfig, checkpoint: Path, run_dir: Path, inputs: Mapping[str, Any]
) -> None:
    """Refuse a resume whose config changes what the saved state means."""
    state = json.loads((checkpoint / "driver.json").read_text())
    saved, saved_inputs = state.get("config"), state.get("inputs")
    source = checkpoint / "driver.json"
    if not isinstance(saved, dict) and (run_dir / "config.yaml").is_file():
        saved, source = (
            yaml.safe_load((run_dir / "config.yaml").read_text()),
            run_dir / "config.yaml",
        )
    if not isinstance(saved, dict):
        return
    changes = resume_config_changes(
        saved,
        cfg.to_dict(),
        saved_inputs=saved_inputs if isinstance(saved_inputs, dict) else None,
        inputs=inputs,
    )
    if changes:
        raise StartupError(
            f"--resume: {len(changes)} key(s) differ from the config the run in {run_dir} was "
            f"saved with ({source}), and they fix the meaning of its saved state:\n"
            + "".join(f"  - {c}\n" for c in changes)
            + "Continue with the saved values, or start a new run (--overwrite, or another "
            "--run-dir)"
        )


# ------------------------------------------------------------------- signals


class _Interrupt(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler of a running ``train``."""


class _SignalGuard:
    """SIGINT and SIGTERM stop ``train`` cleanly: the first one raises :class:`_Interrupt`
    in the main thread (after the checkpoint being written, if one is), later ones only
    log while the teardown runs. Main thread only (elsewhere Python allows no handlers);
    installed again after ``ray.init``, which sets its own SIGTERM handler (an exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._raised = False
        self._defer = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            log.warning("%s: already stopping (shutting down); SIGKILL forces an exit", name)
            return
        self.received = signum
        if self._defer:
            log.warning("%s: stopping once the checkpoint being written is complete", name)
            return
        log.warning("%s: stopping; shutting down the workers, the engines and Ray", name)
        self._raise()

    def _raise(self) -> None:
        self._raised = True
        raise _Interrupt(self.received)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal arriving inside takes effect when the block completes."""
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
        if not self._defer and self.received is not None and not self._raised:
            log.warning("checkpoint complete; stopping")
            self._raise()


# ------------------------------------------------------------------- the run


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
    ``keep_ray`` leaves the Ray cluster up (tests share one per module).

    ``config``: a :class:`~ppo_driver.config.ValidConfig`, or a ``DriverConfig`` that is
    validated here first (:class:`~ppo_driver.config.ConfigError` with every problem,
    before anything starts), so the Python API gets the CLI's refusals.
    """
    t_run = time.perf_counter()
    cfg = validated(config).config
    fail_at = parse_fail_at(fail_at if fail_at is not None else os.environ.get(FAIL_ENV))
    if resume and overwrite:
        raise StartupError("--resume and --overwrite exclude each other: choose one")
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    guard = _SignalGuard()
    guard.install()
    lock: RunLock | None = None
    try:
        _open_run_dir(run_dir)
        lock = RunLock.acquire(run_dir)
        removed = _claim_contents(run_dir, resume=resume, overwrite=overwrite)
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
            return _run(
                cfg,
                run_dir=run_dir,
                inputs=inputs,
                latest=latest,
                fail_at=fail_at,
                on_step=on_step,
                keep_ray=keep_ray,
                guard=guard,
                t_run=t_run,
            )
        finally:
            logging.getLogger("ppo_driver").removeHandler(handler)
            handler.close()
    except BaseException as exc:
        if guard.received is None:
            raise
        stopped = RunStopped(guard.received, run_dir=run_dir, checkpoint=find_latest(ckpt_dir))
        raise stopped from (None if isinstance(exc, _Interrupt) else exc)
    finally:
        guard.restore()
        if lock is not None:
            lock.release()


@dataclass
class _Built:
    """Everything a run drives, built in :func:`_build`."""

    actor: TrainGroup
    critic: TrainGroup
    engines: list[Any]
    generation: _Generation
    sampler: Sampler
    manager: RolloutManager
    trace: TraceRecorder
    pump: TrainPump
    evaluator: Evaluator | None = None  # rollout.eval_dataset_path, every run.eval_every steps
    policy_spec: ModelSpec | None = None  # what the HF export at the end describes
    inputs: dict[str, Any] = field(default_factory=dict)  # resume_inputs, saved each time
    doing: str = "starting the models"  # what the run is doing, for a fault's message


def _run(
    cfg: DriverConfig,
    *,
    run_dir: Path,
    inputs: dict[str, Any],
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
            built = _build(
                cfg, run_dir=run_dir, fail_at=fail_at, keep_ray=keep_ray, on_exit=on_exit
            )
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
            raise _fault(exc, built, run_dir=run_dir, cluster_lost=cluster_lost) from exc
    result.wall_s = time.perf_counter() - t_run
    _summary(result, cfg)
    return result


_TEARDOWN_WITHOUT_RAY = frozenset({"trace and reward plot", "metrics file"})
"""Teardown steps that still run when the Ray cluster is gone (the rest would block on
the lost GCS until Ray ends the process)."""

_REPORTED_ELSEWHERE = (StartupError, InjectedFailure, NonFiniteError, RewardFailure)
"""Exceptions ``train`` raises as they are (each has its own message in the CLI)."""


def describe_fault(exc: BaseException) -> str:
    """``exc`` in one line for the user: what failed, naming the file or the process
    (an exception raised in a Ray worker: the worker's exception and where it ran)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        inner = describe_fault(cause) if cause is not None else _first_line(exc)
        # the error as raised by ray.get is also the cause's class: not every attribute
        # of RayTaskError is set on it
        title = getattr(exc, "proctitle", None) or getattr(exc, "function_name", "a Ray task")
        where = f"pid {getattr(exc, 'pid', '?')} on {getattr(exc, 'ip', '?')}"
        return f"{inner} (in {title}, {where})"
    if isinstance(exc, OSError) and exc.strerror:
        names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
        where = f": {' -> '.join(names)}" if names else ""
        return f"{exc.strerror} ({type(exc).__name__}{where})"
    if isinstance(exc, ray.exceptions.RayActorError) and not str(exc).strip():
        return f"a Ray actor died ({type(exc).__name__})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _from_ray(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ray error or was raised from one (a :class:`WorkerLost`
    wraps the ``RayActorError`` of a dead rank, which a lost cluster also causes)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ray.exceptions.RayError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _name_the_worker(exc: Exception, built: _Built | None) -> Exception:
    """``exc`` as the :class:`WorkerLost` of the trainer rank it is about, when a trainer
    worker died and the call that saw it was not made through its group (the refit
    calls the actor's ranks directly); otherwise ``exc``."""
    if built is None or not isinstance(exc, ray.exceptions.RayActorError):
        return exc
    for group in (built.actor, built.critic):
        if group.owns(exc):
            return group.lost(exc)
    return exc


def _fault(
    exc: Exception, built: _Built | None, *, run_dir: Path, cluster_lost: threading.Event
) -> RunFailed:
    """A fault during the run as :class:`RunFailed`; its traceback goes to ``train.log``
    (not the terminal). A Ray error (or one raised from it) while the cluster's GCS does
    not answer is a lost cluster: the teardown then skips what would wait for it."""
    lost = isinstance(exc, ClusterLost) or (_from_ray(exc) and not cluster_reachable())
    what = describe_fault(_name_the_worker(exc, built))
    if lost:
        cluster_lost.set()
        if not isinstance(exc, ClusterLost):
            what = f"the Ray cluster's head ({gcs_address()}) does not answer: {what}"
    doing = built.doing if built is not None else "starting up"
    step = built.pump.completed_steps if built is not None else 0
    failed = RunFailed(step=step, what=f"{what}; while {doing}", run_dir=run_dir)
    failed.cluster_lost = lost
    log.error("%s; the traceback:", failed, exc_info=exc, extra=_FILE_ONLY)
    return failed


def _build(
    cfg: DriverConfig,
    *,
    run_dir: Path,
    fail_at: str | None,
    keep_ray: bool,
    on_exit: Callable[[str, Callable[[], object]], None],
) -> _Built:
    """The cluster, the shared placement, the worker processes (models not built yet),
    the engines, the data and the pump."""
    t0 = time.perf_counter()
    workload = load_workload(cfg)  # before Ray: data, tokenizer and reward errors stop here
    layout = cluster_layout(cfg)
    _connect_cluster(cfg, layout, keep_ray=keep_ray, on_exit=on_exit)
    log.info("start-up: Ray up after %.1f s", time.perf_counter() - t0)

    tokenizer = workload.tokenizer
    actor_cfg, critic_cfg = trainer_configs(cfg, vocab_size=tokenizer.vocab_size)
    try:
        placement = SharedPlacement(layout).create()  # actor rank r and critic rank r: bundle r
    except TimeoutError as exc:  # resources taken by others on a joined cluster
        raise StartupError(f"cluster: {exc}") from None
    on_exit("placement teardown", placement.teardown)
    log_file = (str((run_dir / "train.log").resolve()), cfg.run.log_level)
    actor = TrainGroup(
        "actor", ActorWorker, actor_cfg, slots=list(placement.actor_view()), log_file=log_file
    )
    on_exit("actor workers", actor.kill)
    critic = TrainGroup(
        "critic", CriticWorker, critic_cfg, slots=list(placement.critic_view()), log_file=log_file
    )
    on_exit("critic workers", critic.kill)
    log.info("start-up: placement: %s", _where(placement))
    engines = _launch_engines(cfg, actor_cfg.model, list(placement.rollout_view()), on_exit=on_exit)
    refitter = WeightRefitter(
        actor=actor.handles[0],
        peers=actor.handles[1:],
        engines=engines,
        backend=_refit_backend(cfg),
        master_addr=placement.actor_view()[0].node_ip,  # the store listens on rank 0's node
    )
    generation = _Generation(engines, refitter)

    sampler = make_sampler(sampler_config(cfg))
    lookahead = cfg.async_rl.sampler.max_lookahead_versions
    manager = RolloutManager(
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
        max_in_flight=cfg.async_rl.max_prompts_in_flight or cfg.batch_groups * (1 + lookahead),
        groups_per_call=1,
        on_engine_restart=refitter.restore_engine,
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        file_in_dispatch_order=cfg.async_rl.deterministic_chunks,
        max_consecutive_group_failures=cfg.rollout.max_consecutive_group_failures,
    )
    trace = TraceRecorder(origin=t0)
    mode = "streaming" if cfg.streaming else "full-batch"

    def write_outputs() -> None:
        trace.write(run_dir / "trace.json")
        metrics_path = run_dir / "metrics.jsonl"
        rows = read_metrics(metrics_path) if metrics_path.exists() else []
        if rows:
            plot_rewards(
                rows, run_dir / "reward.png", title=f"{cfg.run.name}: mean reward ({mode})"
            )

    on_exit("trace and reward plot", write_outputs)
    pump = TrainPump(
        cfg,
        actor=actor,
        critic=critic,
        rollout=manager,
        generation=generation,
        sampler=sampler,
        pad_id=tokenizer.pad_id,
        trace=trace,
        fail_at=fail_at,
        step_of=manager.buffer.step_of,
    )
    evaluator = None
    if workload.eval_dataset is not None:
        evaluator = Evaluator(
            engines=engines,
            dataset=workload.eval_dataset,
            reward_fn=workload.reward_fn,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=workload.stop_token_ids,
            timeout_s=cfg.rollout.reward_timeout_s,
        )
    return _Built(
        actor,
        critic,
        engines,
        generation,
        sampler,
        manager,
        trace,
        pump,
        evaluator=evaluator,
        policy_spec=actor_cfg.model,
    )


def _start(built: _Built, *, latest: Path | None, t_run: float) -> int | None:
    """Start the models one at a time (two full models and optimizers never need to fit
    at once): build the actor -> load its checkpoint -> put it fully to sleep -> build
    the critic -> load. Then restore every other stateful part from ``latest``; returns
    the step resumed from (``None``: a fresh run). Colocated, the engines have released
    their memory before the actor is built (they start released)."""
    actor, critic, trace = built.actor, built.critic, built.trace
    if built.pump.cfg.cluster.colocate:
        with trace.span("start engines (released)", phase="startup"):
            ray.get([e.health.remote() for e in built.engines])
        log.info("start-up: %d engine(s) up, memory released", len(built.engines))
    with trace.span("start actor", phase="startup"):
        actor.build()
        if latest is not None:
            actor.call("load_checkpoint", path=str(latest / "actor"))
        actor.call("sleep", parts=ALL_PARTS)
    log.info("start-up: actor built%s and asleep", " and loaded" if latest else "")
    with trace.span("start critic", phase="startup"):
        critic.build()
        if latest is not None:
            critic.call("load_checkpoint", path=str(latest / "critic"))
    ray.get([e.health.remote() for e in built.engines])
    log.info(
        "start-up: worker processes: %s",
        "; ".join(
            f"{g.role} rank {r} pid {pid} on {ip}"
            for g in (actor, critic)
            for r, (pid, ip) in enumerate(g.processes)
        ),
    )
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
        groups = {Role.ACTOR: built.actor, Role.CRITIC: built.critic}
        pump.save_models(
            lambda role: groups[role].call("save_checkpoint", path=str(tmp / role)),
            step=step_done,
        )

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
    on_exit: Callable[[str, Callable[[], object]], None],
) -> RunResult:
    """The step loop: one PPO step, its metrics line, a checkpoint when due."""
    pump = built.pump
    metrics_writer = MetricsWriter(
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
    on_exit("metrics file", metrics_writer.close)
    result = RunResult(
        run_dir=run_dir, completed_steps=pump.completed_steps, resumed_from=resumed_from
    )
    log.info(
        "ppo-driver: %s, %d prompts x %d samples per step, minimum %d groups, %d step(s) -> %s",
        "streaming" if cfg.streaming else "full-batch",
        cfg.batch_groups,
        cfg.ppo.num_generations_per_prompt,
        cfg.min_groups,
        cfg.run.num_steps,
        run_dir,
    )
    while pump.completed_steps < cfg.run.num_steps:
        built.doing = f"training step {pump.completed_steps}"
        report = pump.run_step()
        result.reports.append(report)
        metrics = report.metrics
        if built.generation.last_refit is not None:
            metrics["perf/refit_bytes"] = built.generation.last_refit.bytes
        metrics.update(_evaluate(cfg, built, step_done=pump.completed_steps))
        metrics_writer.write(metrics)
        result.metrics.append(metrics)
        result.completed_steps = pump.completed_steps
        bar = (
            _progress_bar(pump.completed_steps, cfg.run.num_steps) + " " if cfg.run.progress else ""
        )
        log.info("%s%s", bar, format_step_line(metrics))
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
            _export_policy(cfg, built, run_dir / "hf")
    return result


def _export_policy(cfg: DriverConfig, built: _Built, out: Path) -> None:
    """``<run dir>/hf/``: ``config.json`` + ``model.safetensors`` of the trained policy
    (loads with ``AutoModelForCausalLM.from_pretrained``), with the tokenizer files when
    the policy came from ``policy.model_path`` (the built-in task's character tokenizer
    is not a Hugging Face one). Written aside, then renamed over the previous export."""
    assert built.policy_spec is not None
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        # not ours to delete: the export would have replaced it
        raise NotADirectoryError(
            errno.ENOTDIR, "the policy export's path is taken by a file (move it away)", str(out)
        )
    weights = built.pump.export_policy()
    tmp = out.with_name(out.name + ".tmp")
    _remove(tmp)
    try:
        save_hf_checkpoint(weights=weights, spec=built.policy_spec, path=tmp, role="policy")
        source = cfg.policy.model_path
        if source is not None:
            AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(str(tmp))
            generation = Path(source) / "generation_config.json"
            if generation.is_file():
                shutil.copy2(generation, tmp / generation.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        _remove(tmp)  # nothing half-written stays
        raise
    log.info("policy exported to %s (Hugging Face format)", out)


def _remove(path: Path) -> None:
    """Remove ``path`` (a directory tree or a file) if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
