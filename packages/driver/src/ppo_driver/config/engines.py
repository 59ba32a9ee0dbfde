"""What this machine and the cluster offer: the cluster address or the local cluster's
CPUs and GPUs, the generation engine and its server arguments, the offload backend on
this device, and the optional extras (sglang, tensorboard).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from ppo_placement import (
    Layout,
    cluster_address_problem,
)
from ppo_trainer import (
    OFFLOAD_BACKENDS,
    memory_saver_problem,
)

from ppo_driver.config.packages import ROLES, _section, cluster_layout
from ppo_driver.config.problems import ConfigProblem, ValidationReport
from ppo_driver.config.schema import DriverConfig


def _check_offload_backend(r: ValidationReport, cfg: DriverConfig) -> None:
    """``policy/critic.offload_backend`` on this machine's device, as the trainer's
    backends resolve it (``ppo_trainer.resolve_offload_backend``): ``memory_saver`` needs
    CUDA, torch_memory_saver and the torch backend (Megatron: ``host_copy`` only);
    ``none`` (offload off, the shared actor/critic report's debugging switch) is warned
    about."""
    device = "cuda" if _cuda_available() else "cpu"
    for role in ROLES:
        section = _section(role)
        m = cfg.model(role)
        key = f"{section}.offload_backend"
        if m.offload_backend not in OFFLOAD_BACKENDS or any(p.key == key for p in r.errors):
            continue  # the trainer's config check reports an unknown name
        if m.offload_backend == "none":
            r.warnings.append(
                ConfigProblem(
                    key,
                    "none",
                    f"offload is off: the {role} stays on the training devices while the other "
                    "model works, so both models and their optimizer states must fit there "
                    "at once (for debugging offload only)",
                    f"set {key}=auto to time-share the devices",
                    severity="warning",
                )
            )
        if m.offload_backend not in ("memory_saver", "torch_memory_saver"):
            continue  # auto, host_copy and none run everywhere
        backend = "megatron" if m.megatron_cfg.enabled else "torch"
        problem = memory_saver_problem(device=device, backend=backend, key=key)
        if problem is not None:
            r.errors.append(ConfigProblem(key, m.offload_backend, *problem))


ENGINES = ("embedded", "sglang")


"""``rollout.engine`` values: the plain-torch engine (CPU or GPU) and sglang (CUDA)."""


SGLANG_EXTRA = "ppo-driver[sglang]"


TENSORBOARD_EXTRA = "ppo-driver[tensorboard]"


# sglang.Engine arguments the driver sets itself: the key that decides each, or why.
_SGLANG_RESERVED = {
    "model_path": "policy.model_path (the built-in tiny model is written for it)",
    "random_seed": "run.seed",
    "skip_tokenizer_init": "the driver hands sglang token ids and reads token ids back",
    "tp_size": "each engine holds one rollout GPU (more GPUs: more rollout.num_engines)",
}


def _module_available(name: str) -> bool:
    """Whether ``name`` can be imported here (not imported: no side effects)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check_cluster_address(r: ValidationReport, cfg: DriverConfig) -> None:
    """``cluster.address``: null (a local cluster), ``auto`` or ``host:port`` (join)."""
    address = cfg.cluster.address
    if address is None:
        _check_local_cluster(r, cfg)
        return
    if not cfg.cluster.logical_gpus:
        r.warnings.append(
            ConfigProblem(
                "cluster.logical_gpus",
                False,
                "has no effect when joining a cluster (cluster.address is set): its nodes' "
                "`ray start --num-gpus` decide the GPUs",
                "remove cluster.logical_gpus",
                severity="warning",
            )
        )
    problem = cluster_address_problem(address)
    if problem is not None:
        head, fix = problem
        r.errors.append(
            ConfigProblem(
                "cluster.address", address, head, f"{fix}, or null to start a local cluster"
            )
        )
    if cfg.cluster.num_cpus is not None:
        r.warnings.append(
            ConfigProblem(
                "cluster.num_cpus",
                cfg.cluster.num_cpus,
                "has no effect when joining a cluster (cluster.address is set): its nodes' "
                "`ray start --num-cpus/--num-gpus` decide the resources",
                "remove cluster.num_cpus",
                severity="warning",
            )
        )


def cuda_device_count() -> int:
    """CUDA devices this machine has (0 without CUDA)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def local_num_cpus(cfg: DriverConfig, layout: Layout) -> int:
    """The CPUs of the local Ray cluster ``train`` starts: ``cluster.num_cpus``, or by
    default enough for every bundle (one CPU each) and at least
    ``max(4, 2 * actor_gpus + num_engines)``."""
    if cfg.cluster.num_cpus is not None:
        return cfg.cluster.num_cpus
    return max(4, 2 * cfg.cluster.actor_gpus + cfg.rollout.num_engines, layout.num_gpus)


def _check_local_cluster(r: ValidationReport, cfg: DriverConfig) -> None:
    """The local cluster: each bundle the layout reserves takes one CPU of
    ``cluster.num_cpus`` and one GPU (``cluster.logical_gpus=false``: one of the machine's
    CUDA devices)."""
    try:
        needed = cluster_layout(cfg).num_gpus
    except ValueError:
        return  # the layout's own error is reported already
    num_cpus = cfg.cluster.num_cpus
    if num_cpus is not None and 0 < num_cpus < needed:
        r.errors.append(
            ConfigProblem(
                "cluster.num_cpus",
                num_cpus,
                f"the layout reserves {needed} bundle(s) of 1 GPU + 1 CPU "
                f"(cluster.actor_gpus={cfg.cluster.actor_gpus}, "
                f"cluster.rollout_gpus={cfg.cluster.rollout_gpus}), more than the local "
                "cluster's CPUs: the placement group could never be created",
                f"set cluster.num_cpus to at least {needed}, or null (enough for the layout)",
            )
        )
    if cfg.cluster.logical_gpus:
        return
    have = cuda_device_count()
    if have < needed:
        r.errors.append(
            ConfigProblem(
                "cluster.logical_gpus",
                False,
                f"this machine has {have} CUDA device(s), and the layout reserves {needed} "
                f"(cluster.actor_gpus={cfg.cluster.actor_gpus}, "
                f"cluster.rollout_gpus={cfg.cluster.rollout_gpus})",
                "set cluster.logical_gpus=true (logical GPUs: CPU runs and tests), ask for "
                "fewer GPUs, or run on a machine with enough",
            )
        )


def _check_engine(r: ValidationReport, cfg: DriverConfig) -> None:
    """``rollout.engine`` and what it needs: sglang wants its extra, CUDA and a GPU per
    engine; ``rollout.engine_kwargs`` are sglang's own server arguments."""
    ro = cfg.rollout
    if ro.engine not in ENGINES:
        close = difflib.get_close_matches(str(ro.engine), ENGINES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        r.errors.append(
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                f"unknown generation engine{hint}",
                f"set rollout.engine to one of {', '.join(ENGINES)}",
            )
        )
        return
    if ro.engine == "embedded":
        if ro.engine_kwargs:
            r.errors.append(
                ConfigProblem(
                    "rollout.engine_kwargs",
                    ro.engine_kwargs,
                    "only the sglang engine reads it (rollout.engine=embedded)",
                    "remove rollout.engine_kwargs, or set rollout.engine=sglang",
                )
            )
        return
    _check_sglang_here(r, cfg)
    if ro.num_engines > cfg.cluster.rollout_gpus >= 1:
        r.errors.append(
            ConfigProblem(
                "rollout.num_engines",
                ro.num_engines,
                f"each sglang engine needs a rollout GPU of its own, and cluster.rollout_gpus="
                f"{cfg.cluster.rollout_gpus}",
                f"set rollout.num_engines to at most {cfg.cluster.rollout_gpus}, or raise "
                "cluster.rollout_gpus",
            )
        )
    if ro.decode_delay_s:
        r.warnings.append(
            ConfigProblem(
                "rollout.decode_delay_s",
                ro.decode_delay_s,
                "has no effect with rollout.engine=sglang (only the embedded engine emulates "
                "a slower device)",
                "remove rollout.decode_delay_s",
                severity="warning",
            )
        )
    _check_engine_kwargs(r, cfg)


def _check_sglang_here(r: ValidationReport, cfg: DriverConfig) -> None:
    """sglang's package and CUDA: an error on a local cluster, a warning when joining one
    (the engines run on its GPU nodes)."""
    ro = cfg.rollout
    missing = []
    if not _module_available("sglang"):
        missing.append(
            f"the sglang package (the extra {SGLANG_EXTRA}: `uv sync --extra sglang` in this "
            "workspace, `pip install 'ppo-driver[sglang]'` elsewhere)"
        )
    if not _cuda_available():
        missing.append("CUDA (sglang generates on NVIDIA GPUs; this machine has none)")
    if missing and cfg.cluster.address is None:
        r.errors.append(
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                "the sglang engine cannot run on this machine: it needs " + " and ".join(missing),
                f"install {SGLANG_EXTRA} on a CUDA machine, or set rollout.engine=embedded "
                "(runs anywhere, CPU included)",
            )
        )
    elif missing:
        r.warnings.append(
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                "this machine lacks " + " and ".join(missing) + "; that is fine only if the "
                f"cluster at cluster.address={cfg.cluster.address} has them on its GPU nodes "
                "(the engines run there)",
                f"install {SGLANG_EXTRA} and CUDA on the cluster's GPU nodes",
                severity="warning",
            )
        )


def _check_engine_kwargs(r: ValidationReport, cfg: DriverConfig) -> None:
    """sglang server arguments: none the driver sets itself, and (where sglang imports)
    only names ``sglang.srt.server_args.ServerArgs`` knows."""
    kwargs = cfg.rollout.engine_kwargs
    for name, why in _SGLANG_RESERVED.items():
        if name in kwargs:
            r.errors.append(
                ConfigProblem(
                    f"rollout.engine_kwargs.{name}",
                    kwargs[name],
                    f"the driver sets it: {why}",
                    f"remove rollout.engine_kwargs.{name}",
                )
            )
    known = _sglang_server_args()
    if known is not None:
        for name in kwargs:
            if name not in known and name not in _SGLANG_RESERVED:
                close = difflib.get_close_matches(str(name), sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                r.errors.append(
                    ConfigProblem(
                        f"rollout.engine_kwargs.{name}",
                        kwargs[name],
                        f"not an sglang server argument (sglang.srt.server_args.ServerArgs){hint}",
                        f"remove rollout.engine_kwargs.{name}, or use an argument of "
                        "`python -m sglang.launch_server --help` (with _ for -)",
                    )
                )
    if cfg.cluster.colocate:
        _check_colocated_sglang(r, cfg)


def _check_colocated_sglang(r: ValidationReport, cfg: DriverConfig) -> None:
    """sglang on the training GPUs: it must keep a copy of its weights across a critic
    warm-up, and should leave the trainers memory."""
    kwargs = cfg.rollout.engine_kwargs
    if cfg.ppo.critic_warmup_steps > 0 and kwargs.get("enable_weights_cpu_backup", True) is False:
        r.errors.append(
            ConfigProblem(
                "rollout.engine_kwargs.enable_weights_cpu_backup",
                False,
                "with cluster.colocate=true sglang releases its memory while training runs "
                "and, without this backup, loses its weights; a critic warm-up step "
                f"(ppo.critic_warmup_steps={cfg.ppo.critic_warmup_steps}) refits nothing "
                "before generation resumes, so the engine would have no weights",
                "remove rollout.engine_kwargs.enable_weights_cpu_backup (it defaults to true "
                "when colocated), or set ppo.critic_warmup_steps=0",
            )
        )
    if "mem_fraction_static" not in kwargs and not any(p.key == "rollout.engine" for p in r.errors):
        r.warnings.append(
            ConfigProblem(
                "rollout.engine_kwargs.mem_fraction_static",
                None,
                "with cluster.colocate=true sglang shares the training GPUs, but by default "
                "it reserves most of a GPU's memory for itself",
                "set rollout.engine_kwargs.mem_fraction_static (e.g. 0.3) to leave the "
                "trainers room",
                severity="warning",
            )
        )


def _sglang_server_args() -> frozenset[str] | None:
    """The fields of sglang's ``ServerArgs`` (None when sglang does not import here, or
    when its ``ServerArgs`` is of a kind this does not know: the keys are then not
    checked, and sglang itself refuses an unknown one at start-up).

    ``ServerArgs`` was a dataclass up to sglang 0.5.x and is a msgspec ``Struct`` in
    0.5.23 (``dataclasses.fields`` raises TypeError on it), so both are read; validate
    never raises, so nothing here may either."""
    if not _module_available("sglang"):
        return None
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # a broken or CUDA-less install: the engine reports it at start-up
        return None
    return _struct_field_names(ServerArgs)


def _struct_field_names(cls: Any) -> frozenset[str] | None:
    """The field names of a dataclass or a msgspec ``Struct`` class, else None."""
    try:
        if dataclasses.is_dataclass(cls):
            return frozenset(f.name for f in dataclasses.fields(cls))
        if _module_available("msgspec"):  # sglang depends on it
            import msgspec

            if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
                return frozenset(f.name for f in msgspec.structs.fields(cls))
    except Exception:  # an unexpected sglang or msgspec: the keys are not checked
        return None
    return None


def _check_tensorboard(r: ValidationReport, cfg: DriverConfig) -> None:
    """``run.tensorboard`` needs the tensorboard package (an optional extra)."""
    if cfg.run.tensorboard and not _module_available("tensorboard"):
        r.errors.append(
            ConfigProblem(
                "run.tensorboard",
                True,
                "writing TensorBoard event files needs the tensorboard package, which is not "
                "installed",
                f"install the extra {TENSORBOARD_EXTRA} (in this workspace: `uv sync --extra "
                "tensorboard`), or set run.tensorboard=false (metrics.jsonl is written either "
                "way)",
            )
        )
