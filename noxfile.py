"""Project sessions. `uv run nox` (the README's test command) runs the default set;
CI (`.ci/run`) runs that and then `uv run nox -s slow`.

One source of truth for the package list: the workspace members in the root
pyproject.toml. Each package session installs ONLY that package (plus its CI extras
and the dev tools) into its own venv with an exact `uv sync --package`, so an import
the package does not declare fails its own tests. `dist` builds every package's wheel
and sdist and checks each wheel installed alone (tools/check_dist.py).

Markers (root pyproject.toml): the package sessions run `not slow and not gpu`; `slow`
runs the `slow` tests (the minutes-long end-to-end drills) of every package; `gpu` tests
need CUDA and the GPU extras, which no session here installs (on a GPU node:
`uv run pytest -m gpu packages`).

`all` (every package's tests in one environment) is NOT in CI, because the others cover
it: the driver session installs every package together (the driver depends on the four
others), and the `slow` session syncs every package into one environment and collects
every package's tests there (so a clash between packages' test modules fails it).
"""

from __future__ import annotations

import glob
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
CI_EXTRAS: dict[str, list[str]] = {"trainer": ["megatron"]}
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


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Every benchmark in bench/ (not part of CI); pass names to pick some: -- sampler."""
    _sync(session, "--all-packages", *ALL_EXTRAS, compile_bytecode=True)
    wanted = set(session.posargs)
    scripts = sorted((ROOT / "bench").glob("bench_*.py"))
    if wanted:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    if not scripts:
        session.error(f"no benchmark matched {sorted(wanted)}; have {[s.stem for s in scripts]}")
    for script in scripts:
        session.run("python", str(script), env={"PYTHONDONTWRITEBYTECODE": ""})
