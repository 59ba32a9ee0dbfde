"""The generation engines' rules in ``validate`` (``rollout.engine`` and what it needs):
sglang wants its extra, CUDA and a GPU per engine; ``rollout.engine_kwargs`` are sglang's
own server arguments, minus those the driver sets itself (``SglangEngine`` does).

Not imported by ``ppo_driver.rollout`` itself: ``ppo_driver.config`` calls
:func:`engine_problems`, and the engines never need it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping

from ppo_driver import _machine
from ppo_driver.config.problems import ConfigProblem, warning
from ppo_driver.config.schema import DriverConfig

ENGINES = ("embedded", "sglang")
"""``rollout.engine`` values: the plain-torch engine (CPU or GPU) and sglang (CUDA)."""

SGLANG_EXTRA = "ppo-driver[sglang]"

# sglang.Engine arguments the driver sets itself: the key that decides each, or why.
SGLANG_RESERVED = {
    "model_path": "policy.model_path (the built-in tiny model is written for it)",
    "random_seed": "run.seed",
    "skip_tokenizer_init": "the driver hands sglang token ids and reads token ids back",
    "tp_size": "each engine holds one rollout GPU (more GPUs: more rollout.num_engines)",
}


def _did_you_mean(name: object, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def engine_problems(cfg: DriverConfig) -> list[ConfigProblem]:
    """Every problem of ``rollout.engine`` and the keys it reads (errors and warnings)."""
    ro = cfg.rollout
    if ro.engine not in ENGINES:
        return [
            ConfigProblem(
                "rollout.engine",
                ro.engine,
                f"unknown generation engine{_did_you_mean(ro.engine, ENGINES)}",
                f"set rollout.engine to one of {', '.join(ENGINES)}",
            )
        ]
    if ro.engine == "embedded":
        if not ro.engine_kwargs:
            return []
        return [
            ConfigProblem(
                "rollout.engine_kwargs",
                ro.engine_kwargs,
                "only the sglang engine reads it (rollout.engine=embedded)",
                "remove rollout.engine_kwargs, or set rollout.engine=sglang",
            )
        ]
    out = _sglang_here(cfg)
    gpus = cfg.cluster.rollout_gpus
    if ro.num_engines > gpus >= 1:
        out.append(
            ConfigProblem(
                "rollout.num_engines",
                ro.num_engines,
                f"each sglang engine needs a rollout GPU of its own, and cluster.rollout_gpus={gpus}",
                f"set rollout.num_engines to at most {gpus}, or raise cluster.rollout_gpus",
            )
        )
    if ro.decode_delay_s:
        out.append(
            warning(
                "rollout.decode_delay_s",
                ro.decode_delay_s,
                "has no effect with rollout.engine=sglang (only the embedded engine emulates "
                "a slower device)",
                "remove rollout.decode_delay_s",
            )
        )
    out += _kwargs_problems(ro.engine_kwargs)
    if cfg.cluster.colocate:
        engine_ok = not any(p.key == "rollout.engine" and p.severity == "error" for p in out)
        out += _colocated_problems(cfg, engine_ok=engine_ok)
    return out


def _sglang_here(cfg: DriverConfig) -> list[ConfigProblem]:
    """sglang's package and CUDA: an error on a local cluster, a warning when joining one
    (the engines run on its GPU nodes)."""
    missing = []
    if not _machine.module_available("sglang"):
        missing.append(
            f"the sglang package (the extra {SGLANG_EXTRA}: `uv sync --extra sglang` in this "
            "workspace, `pip install 'ppo-driver[sglang]'` elsewhere)"
        )
    if not _machine.cuda_available():
        missing.append("CUDA (sglang generates on NVIDIA GPUs; this machine has none)")
    if not missing:
        return []
    if cfg.cluster.address is None:
        return [
            ConfigProblem(
                "rollout.engine",
                cfg.rollout.engine,
                "the sglang engine cannot run on this machine: it needs " + " and ".join(missing),
                f"install {SGLANG_EXTRA} on a CUDA machine, or set rollout.engine=embedded "
                "(runs anywhere, CPU included)",
            )
        ]
    return [
        warning(
            "rollout.engine",
            cfg.rollout.engine,
            "this machine lacks " + " and ".join(missing) + "; that is fine only if the "
            f"cluster at cluster.address={cfg.cluster.address} has them on its GPU nodes "
            "(the engines run there)",
            f"install {SGLANG_EXTRA} and CUDA on the cluster's GPU nodes",
        )
    ]


def _kwargs_problems(kwargs: Mapping[str, object]) -> list[ConfigProblem]:
    """sglang server arguments: none the driver sets itself, and (where sglang imports)
    only names ``sglang.srt.server_args.ServerArgs`` knows."""
    out = [
        ConfigProblem(
            f"rollout.engine_kwargs.{name}",
            kwargs[name],
            f"the driver sets it: {why}",
            f"remove rollout.engine_kwargs.{name}",
        )
        for name, why in SGLANG_RESERVED.items()
        if name in kwargs
    ]
    known = sglang_server_args()
    if known is None:
        return out
    for name in kwargs:
        if name not in known and name not in SGLANG_RESERVED:
            out.append(
                ConfigProblem(
                    f"rollout.engine_kwargs.{name}",
                    kwargs[name],
                    "not an sglang server argument (sglang.srt.server_args.ServerArgs)"
                    + _did_you_mean(name, sorted(known)),
                    f"remove rollout.engine_kwargs.{name}, or use an argument of "
                    "`python -m sglang.launch_server --help` (with _ for -)",
                )
            )
    return out


def _colocated_problems(cfg: DriverConfig, *, engine_ok: bool) -> list[ConfigProblem]:
    """sglang on the training GPUs: it must be able to release its memory, keep a copy
    of its weights across a critic warm-up, and should leave the trainers memory."""
    kwargs, warmup = cfg.rollout.engine_kwargs, cfg.ppo.critic_warmup_steps
    out = []
    if kwargs.get("enable_memory_saver", True) is False:
        out.append(
            ConfigProblem(
                "rollout.engine_kwargs.enable_memory_saver",
                False,
                "with cluster.colocate=true sglang must release its GPU memory while the "
                "actor and critic train on the same GPUs; without its memory saver it keeps "
                "its weights, KV cache and CUDA graphs there (and the engine refuses to "
                "release)",
                "remove rollout.engine_kwargs.enable_memory_saver (the driver sets it to true "
                "when colocated), or set cluster.colocate=false",
            )
        )
    if warmup > 0 and kwargs.get("enable_weights_cpu_backup", True) is False:
        out.append(
            ConfigProblem(
                "rollout.engine_kwargs.enable_weights_cpu_backup",
                False,
                "with cluster.colocate=true sglang releases its memory while training runs "
                "and, without this backup, loses its weights; a critic warm-up step "
                f"(ppo.critic_warmup_steps={warmup}) refits nothing before generation "
                "resumes, so the engine would have no weights",
                "remove rollout.engine_kwargs.enable_weights_cpu_backup (it defaults to true "
                "when colocated), or set ppo.critic_warmup_steps=0",
            )
        )
    if "mem_fraction_static" not in kwargs and engine_ok:
        out.append(
            warning(
                "rollout.engine_kwargs.mem_fraction_static",
                None,
                "with cluster.colocate=true sglang shares the training GPUs, but by default "
                "it reserves most of a GPU's memory for itself",
                "set rollout.engine_kwargs.mem_fraction_static (e.g. 0.3) to leave the "
                "trainers room",
            )
        )
    return out


def sglang_server_args() -> frozenset[str] | None:
    """The fields of sglang's ``ServerArgs`` (None when sglang does not import here, or
    when its ``ServerArgs`` is of a kind this does not know: the keys are then not
    checked, and sglang itself refuses an unknown one at start-up).

    ``ServerArgs`` was a dataclass up to sglang 0.5.x and is a msgspec ``Struct`` in
    0.5.23 (``dataclasses.fields`` raises TypeError on it), so both are read; validate
    never raises, so nothing here may either."""
    if not _machine.module_available("sglang"):
        return None
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # a broken or CUDA-less install: the engine reports it at start-up
        return None
    return struct_field_names(ServerArgs)


def struct_field_names(cls: object) -> frozenset[str] | None:
    """The field names of a dataclass or a msgspec ``Struct`` class, else None."""
    try:
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            return frozenset(f.name for f in dataclasses.fields(cls))
        if _machine.module_available("msgspec"):  # sglang depends on it
            import msgspec

            if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
                return frozenset(f.name for f in msgspec.structs.fields(cls))
    except Exception:  # an unexpected sglang or msgspec: the keys are not checked
        return None
    return None
