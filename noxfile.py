"""Project sessions. `uv run nox` (the README's test command) runs the default set;
CI (`.ci/run`) runs that and then `uv run nox -s slow`.

One source of truth for the package list: the workspace members in the root
pyproject.toml. Each package session installs ONLY that package (plus its CI extras
and the dev tools) into its own venv with an exact `uv sync --package`, so an import
the package does not declare fails its own tests. `dist` builds every package's wheel
and sdist and checks each wheel installed alone (tools/check_dist.py).

Markers (root pyproject.toml): the package sessions run `not slow and not gpu`; `slow`
runs the `slow` tests (the minutes-long end-to-end drills) of every package; `gpu` tests
need CUDA and the GPU extras, which only the `gpu` session installs: on a GPU machine
`uv run nox -s gpu` runs them, the cross-process memory test, the offload benchmark and
a 3-step Megatron + TE + sglang run, logs in gpu-check/ (not in CI, not by default).

`all` (every package's tests in one environment) is NOT in CI, because the others cover
it: the driver session installs every package together (the driver depends on the four
others), and the `slow` session syncs every package into one environment and collects
every package's tests there (so a clash between packages' test modules fails it).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True


def _members() -> list[str]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())
    paths: list[str] = []
    for pattern in spec["tool"]["uv"]["workspace"]["members"]:
        paths.extend(sorted(glob.glob(str(ROOT / pattern))))
    return [Path(p).name for p in paths if (Path(p) / "pyproject.toml").exists()]


PACKAGES = _members()
# Extras that CI installs for a package's own tests (never the CUDA-only ones:
# torch-memory-saver, transformer-engine and sglang need a GPU machine).
CI_EXTRAS: dict[str, list[str]] = {"trainer": ["megatron"], "driver": ["tensorboard"]}
ALL_EXTRAS = [a for p in PACKAGES for e in CI_EXTRAS.get(p, []) for a in ("--extra", e)]
# Packages whose tests start Ray workers: their sessions compile all bytecode at install,
# since many workers importing torch at once would each compile the same modules (slow
# start-ups, timeouts). The other sessions skip that (~14,000 files, minutes on two busy
# cores): their single test process compiles, and writes, only what it imports.
RAY_PACKAGES = {"placement", "driver"}
DEFAULT_MARKERS = "not slow and not gpu"
# Order matters little; the cheap sessions go first so failures surface early.
nox.options.sessions = ["lint", "typecheck", "dist", *PACKAGES]


def _sync(session: nox.Session, *args: str, compile_bytecode: bool) -> None:
    """Exact sync of the lockfile into this session's venv."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--active",
        "--exact",
        "--group",
        "dev",
        "--compile-bytecode" if compile_bytecode else "--no-compile-bytecode",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _pytest(session: nox.Session, *paths: str, markers: str) -> None:
    # pytest exits with code 5 when it collects nothing: a run with no tests fails.
    env = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONDONTWRITEBYTECODE": ""}
    args = ["-m", markers, "--durations=10", *paths, *session.posargs]
    session.run("python", "-m", "pytest", *args, env=env)


def _package_session(name: str) -> None:
    @nox.session(name=name, python="3.11")
    def _session(session: nox.Session) -> None:
        extras = [a for e in CI_EXTRAS.get(name, []) for a in ("--extra", e)]
        _sync(session, "--package", f"ppo-{name}", *extras, compile_bytecode=name in RAY_PACKAGES)
        _pytest(session, f"packages/{name}/tests", markers=DEFAULT_MARKERS)

    _session.__doc__ = f"Tests of ppo-{name}, installed alone with its declared dependencies."


for _name in PACKAGES:
    _package_session(_name)


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """The `slow` tests of every package, together in one environment (CI runs it)."""
    _sync(session, "--all-packages", *ALL_EXTRAS, compile_bytecode=True)
    _pytest(session, *(f"packages/{p}/tests" for p in PACKAGES), markers="slow and not gpu")


@nox.session(name="all", python="3.11")
def all_packages(session: nox.Session) -> None:
    """Every test of every package (slow ones too), in one environment (not in CI)."""
    _sync(session, "--all-packages", *ALL_EXTRAS, compile_bytecode=True)
    _pytest(session, *(f"packages/{p}/tests" for p in PACKAGES), markers="not gpu")


# -- the GPU check (a lent GPU machine; never in CI) ----------------------------------------

GPU_CHECK_DIR = Path(os.environ.get("GPU_CHECK_DIR", ROOT / "gpu-check"))
# Upper bounds per step, seconds (the whole session fits 10 minutes on one H200 once
# installed); a step that runs over is killed and reported, the next one still runs.
GPU_STEP_LIMITS = {
    "pytest-gpu": 300,
    "bench-lifecycle": 90,
    "validate-train-config": 60,
    "train-3-steps": 180,
}
_GPU_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONDONTWRITEBYTECODE": ""}
# A 3-step run on one GPU: Megatron + Transformer Engine for both models in bfloat16, sglang
# generating on the same GPU (colocated, so full-batch), a small Qwen2-shaped model.
GPU_TRAIN_YAML = """\
run: {name: gpu-check, num_steps: 3, checkpoint_every: 0, progress: false}
ppo: {num_prompts_per_step: 8, num_generations_per_prompt: 4, critic_mini_batch_size: 16}
async_rl: {min_groups_for_streaming_train: 8}
cluster: {actor_gpus: 1, rollout_gpus: 1, colocate: true, logical_gpus: false}
rollout: {engine: sglang, engine_kwargs: {mem_fraction_static: 0.2}, max_new_tokens: 16}
"""
_MODEL = (
    "hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, dtype: bfloat16"
)
_MEGATRON = "megatron_cfg: {enabled: true, transformer_impl: transformer_engine}"
GPU_TRAIN_YAML += "".join(f"{role}: {{{_MODEL}, {_MEGATRON}}}\n" for role in ("policy", "critic"))


def _require_cuda(session: nox.Session) -> None:
    """Fail before installing anything when this machine has no CUDA GPU."""
    smi = shutil.which("nvidia-smi")
    listed = ""
    if smi is not None:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=120)
        listed = done.stdout if done.returncode == 0 else ""
    if "GPU" not in listed:
        session.error(
            "gpu: no CUDA GPU here (`nvidia-smi -L` lists none"
            + ("" if smi else "; nvidia-smi is not installed")
            + "). This session needs an NVIDIA GPU with its driver: run `uv run nox -s gpu` "
            "on a GPU machine; on this one the CPU sessions are `uv run nox`"
        )


def _logged(session: nox.Session, name: str, *cmd: str, failed: list[str]) -> bool:
    """Run ``cmd`` in the session's venv with its output shown and kept in
    ``<GPU_CHECK_DIR>/<name>.log``, killed after its limit; a failure is recorded and the
    next step still runs. Returns whether it passed."""
    log_file = GPU_CHECK_DIR / f"{name}.log"
    limit = GPU_STEP_LIMITS[name]
    line = f"timeout -k 10 {limit} {shlex.join(cmd)} 2>&1 | tee {shlex.quote(str(log_file))}"
    t0 = time.monotonic()
    try:
        session.run("bash", "-o", "pipefail", "-c", line, external=True, env=_GPU_ENV)
        status = "ok"
    except nox.command.CommandFailed as exc:  # exit 124: killed at its limit
        status = f"FAILED ({exc.reason or 'failed'})"
        failed.append(name)
    with open(GPU_CHECK_DIR / "summary.txt", "a") as summary:
        summary.write(f"{name}: {status} in {time.monotonic() - t0:.0f} s (limit {limit} s)\n")
    return status == "ok"


@nox.session(python="3.11")
def gpu(session: nox.Session) -> None:
    """The GPU check (a lent GPU machine, ~10 min on one H200 once installed): installs
    every extra (Megatron + TE, torch_memory_saver, sglang), then runs every `gpu` test
    (the lifecycle's cross-process test among them: the actor process sleeps, the
    critic process allocates what it freed, by torch.cuda.mem_get_info), the offload
    benchmark, and a 3-step `ppo-driver train` with Megatron + TE + sglang. Logs go to
    gpu-check/ (or $GPU_CHECK_DIR): one file per step, summary.txt, env.txt. Fails fast
    without CUDA. `uv run nox -R -s gpu` reruns without reinstalling; arguments after
    `--` go to pytest (e.g. `-- -k nccl`)."""
    _require_cuda(session)
    _sync(session, "--all-packages", "--all-extras", compile_bytecode=True)
    session.run(
        "python",
        "-c",
        "import sys, torch; sys.exit(0 if torch.cuda.is_available() else "
        "'gpu: torch in this environment sees no CUDA device (a CPU-only torch build, or "
        "CUDA_VISIBLE_DEVICES hides the GPUs)')",
    )
    if GPU_CHECK_DIR.exists():
        shutil.rmtree(GPU_CHECK_DIR)
    GPU_CHECK_DIR.mkdir(parents=True)
    env_info = (
        "import torch, importlib.metadata as m; "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', "
        "torch.cuda.nccl.version(), torch.cuda.get_device_name(0)); "
        "[print(d, m.version(d)) for d in ('megatron-core', 'transformer-engine', "
        "'torch-memory-saver', 'sglang')]"
    )
    with open(GPU_CHECK_DIR / "env.txt", "w") as env_file:
        session.run("python", "-c", env_info, stdout=env_file)
        session.run("nvidia-smi", external=True, stdout=env_file)
    failed: list[str] = []
    packages = [f"packages/{p}/tests" for p in PACKAGES]
    junit = str(GPU_CHECK_DIR / "pytest-gpu.xml")
    pytest_args = ["-m", "gpu", "-rA", "--durations=20", f"--junitxml={junit}"]
    _logged(
        session, "pytest-gpu", "python", "-m", "pytest", *pytest_args, *packages,
        *session.posargs, failed=failed,
    )  # fmt: skip
    _logged(
        session, "bench-lifecycle", "python", "bench/bench_lifecycle.py", "--device", "cuda",
        "--param-gib", "1.0", "--repeats", "2", failed=failed,
    )  # fmt: skip
    config = GPU_CHECK_DIR / "train.yaml"
    config.write_text(GPU_TRAIN_YAML)
    if _logged(
        session, "validate-train-config", "ppo-driver", "validate", "--config", str(config),
        failed=failed,
    ):  # fmt: skip
        _logged(
            session, "train-3-steps", "ppo-driver", "train", "--config", str(config),
            "--run-dir", str(GPU_CHECK_DIR / "train"), "--overwrite", "--no-progress",
            failed=failed,
        )  # fmt: skip
    if failed:
        session.error(f"gpu: failed: {', '.join(failed)}; logs in {GPU_CHECK_DIR}")
    session.log(f"gpu: every check passed; logs in {GPU_CHECK_DIR}")


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """Build each package's sdist and wheel; install each wheel alone and check it."""
    # Only the standard library and uv: this session's venv stays empty.
    session.run("python", "tools/check_dist.py", "--out", session.create_tmp(), *session.posargs)


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy --strict, package by package."""
    _sync(session, "--all-packages", compile_bytecode=False)
    for name in PACKAGES:
        session.run("mypy", "--strict", f"packages/{name}/src")
    # the driver tests' shared helpers (checkpoint readers, derived bounds) are code the
    # equality tests stand on
    session.run("mypy", "--strict", "packages/driver/tests/driver_testlib.py")


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Every benchmark in bench/ (not part of CI); pass names to pick some: -- sampler."""
    every = {s.stem.removeprefix("bench_"): s for s in sorted((ROOT / "bench").glob("bench_*.py"))}
    unknown = sorted(set(session.posargs) - set(every))
    if unknown:  # before the install: a typo is not a silent subset
        session.error(f"no benchmark named {unknown}; have {sorted(every)}")
    scripts = [every[n] for n in session.posargs] if session.posargs else list(every.values())
    _sync(session, "--all-packages", *ALL_EXTRAS, compile_bytecode=True)
    for script in scripts:
        session.run("python", str(script), env={"PYTHONDONTWRITEBYTECODE": ""})
