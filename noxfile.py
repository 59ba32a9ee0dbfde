"""Project sessions. `uv run nox` runs the full set that CI needs.

One source of truth for the package list: the workspace members in the root
pyproject.toml. Each package session installs ONLY that package (plus its CI extras
and the dev tools) into its own venv with an exact `uv sync --package`, so an import
the package does not declare fails its own tests.
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
# Order matters little; the cheap sessions go first so failures surface early.
nox.options.sessions = ["lint", "typecheck", *PACKAGES]


def _sync(session: nox.Session, *args: str) -> None:
    """Exact sync of the lockfile into this session's venv (bytecode compiled)."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--active",
        "--exact",
        "--group",
        "dev",
        *args,
        env={"UV_COMPILE_BYTECODE": "1", "UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _pytest(session: nox.Session, *paths: str) -> None:
    # pytest exits with code 5 when it collects nothing: a run with no tests fails.
    env = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONDONTWRITEBYTECODE": ""}
    session.run("python", "-m", "pytest", *paths, *session.posargs, env=env)


def _package_session(name: str) -> None:
    @nox.session(name=name, python="3.11")
    def _session(session: nox.Session) -> None:
        extras = [a for e in CI_EXTRAS.get(name, []) for a in ("--extra", e)]
        _sync(session, "--package", f"ppo-{name}", *extras)
        _pytest(session, f"packages/{name}/tests")

    _session.__doc__ = f"Tests of ppo-{name}, installed alone with its declared dependencies."


for _name in PACKAGES:
    _package_session(_name)


@nox.session(name="all", python="3.11")
def all_packages(session: nox.Session) -> None:
    """Tests of every package together, in one environment."""
    extras = [a for p in PACKAGES for e in CI_EXTRAS.get(p, []) for a in ("--extra", e)]
    _sync(session, "--all-packages", *extras)
    _pytest(session, *(f"packages/{p}/tests" for p in PACKAGES))


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy --strict, package by package."""
    _sync(session, "--all-packages")
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
    _sync(session, "--all-packages", "--extra", "megatron")
    wanted = set(session.posargs)
    scripts = sorted((ROOT / "bench").glob("bench_*.py"))
    if wanted:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    if not scripts:
        session.error(f"no benchmark matched {sorted(wanted)}; have {[s.stem for s in scripts]}")
    for script in scripts:
        session.run("python", str(script), env={"PYTHONDONTWRITEBYTECODE": ""})
