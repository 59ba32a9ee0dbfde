"""Build every workspace package and check each one installed ALONE, as its users get it.

    uv run --frozen python tools/check_dist.py [--out DIR] [sampler trainer ...]

1. ``uv build --all-packages --no-sources``: an sdist per package and a wheel built FROM
   that sdist (so the sdist is complete), without the workspace's ``tool.uv.sources``.
2. Each wheel carries ``py.typed`` and no test files; its METADATA version equals the
   pyproject version (and the sdist's); its requirements on other ``ppo-*`` packages are
   ranges (``>=a,<b``), never ``==`` nor open-ended.
3. A fresh virtual environment gets the wheel and ONLY what its METADATA declares: the
   ``ppo-*`` requirements from the wheels just built (never an index), third-party ones
   pinned to ``uv.lock`` (``uv export --package ... --no-emit-workspace`` as constraints),
   so torch is the locked build, hard-linked from uv's cache.
4. In that environment, from an empty directory with no PYTHONPATH: the module comes from
   the environment (not the source tree), every name in ``__all__`` resolves (lazy ones
   too), ``__version__`` equals the pyproject version, the first ``python`` block of the
   package README runs (as a doctest when it holds ``>>>`` lines), and the console
   entry points answer (``--help``; see ``SMOKE``).

Standard library only; needs ``uv`` (``$UV`` under ``uv run``, else on PATH). Exit 1 with
every problem listed when a check fails.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = os.environ.get("UV") or shutil.which("uv") or "uv"

# README whose first ``python`` block is a sketch, not a program (kept out of the run, and
# reported); remove a package from here once its README opens with a runnable example.
README_SKETCH: dict[str, str] = {
    "lifecycle": "first python block is the Offloadable protocol's signature sketch",
    "trainer": "first python block is pseudo-code of the streaming calls (needs Ray workers)",
}
# Commands run in the fresh environment besides ``--help`` of every entry point: the
# driver's README example is its CLI, and `validate` reads the config the wheel ships.
SMOKE: dict[str, list[list[str]]] = {
    "driver": [["ppo-driver", "validate"]],
    "sampler": [["python", "-m", "ppo_sampler"]],
}
TEST_FILE = re.compile(
    r"(^|/)(tests?|testing)/|(^|/)(test_[^/]*|[^/]*_test|[^/]*_testlib|conftest)\.py$"
)
REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$")


@dataclass
class Package:
    name: str  # directory name: "sampler"
    dist: str  # distribution: "ppo-sampler"
    module: str  # import name: "ppo_sampler"
    version: str
    path: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def stem(self) -> str:
        return f"{self.module}-{self.version}"


def members() -> list[Package]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = []
    for pattern in spec["tool"]["uv"]["workspace"]["members"]:
        for path in sorted(ROOT.glob(pattern)):
            if not (path / "pyproject.toml").exists():
                continue
            project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
            dist = project["name"]
            module = dist.replace("-", "_")
            out.append(Package(path.name, dist, module, project["version"], path))
    return out


def run(cmd: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """Run ``cmd``; return its output, or raise ``RuntimeError`` quoting the end of it."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        shown = " ".join("<script>" if "\n" in a else a for a in cmd)
        raise RuntimeError(f"`{shown}` exited {proc.returncode}:\n{tail}")
    return proc.stdout


def requirements(metadata: email.message.Message) -> list[tuple[str, str]]:
    """(normalised name, specifier) of each unconditional Requires-Dist."""
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        match = REQ_NAME.match(line)
        if match is None:
            raise ValueError(f"unparsed Requires-Dist {line!r}")
        name, _extras, spec, marker = match.groups()
        if marker and "extra" in marker:
            continue
        out.append((re.sub(r"[-_.]+", "-", name).lower(), spec.strip().strip("()")))
    return out


def wheel_metadata(wheel: Path, stem: str) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        return email.parser.Parser().parsestr(zf.read(f"{stem}.dist-info/METADATA").decode())


def check_archives(pkg: Package, dist_dir: Path) -> email.message.Message | None:
    wheel = dist_dir / f"{pkg.stem}-py3-none-any.whl"
    sdist = dist_dir / f"{pkg.stem}.tar.gz"
    for archive in (wheel, sdist):
        if not archive.exists():
            pkg.problems.append(f"{archive.name} was not built (pyproject version {pkg.version})")
    if pkg.problems:
        return None
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    metadata = wheel_metadata(wheel, pkg.stem)
    if f"{pkg.module}/py.typed" not in names:
        pkg.problems.append(f"{wheel.name} has no {pkg.module}/py.typed")
    tests = [n for n in names if TEST_FILE.search(n)]
    if tests:
        pkg.problems.append(f"{wheel.name} carries test files: {tests}")
    stray = [n for n in names if not n.startswith((f"{pkg.module}/", f"{pkg.stem}.dist-info/"))]
    if stray:
        pkg.problems.append(f"{wheel.name} carries files outside {pkg.module}/: {stray}")
    if metadata["Version"] != pkg.version:
        pkg.problems.append(f"wheel METADATA version {metadata['Version']} != {pkg.version}")
    with tarfile.open(sdist) as tf:
        member = tf.extractfile(f"{pkg.stem}/PKG-INFO")
        sdist_version = email.parser.Parser().parsestr(member.read().decode())["Version"]
    if sdist_version != pkg.version:
        pkg.problems.append(f"sdist PKG-INFO version {sdist_version} != {pkg.version}")
    for name, spec in requirements(metadata):
        if name.startswith("ppo-") and not ("<" in spec and ">=" in spec and "==" not in spec):
            pkg.problems.append(f"requirement {name}{spec}: want a range, >=a,<b")
    return metadata


def readme_example(pkg: Package) -> str | None:
    match = re.search(r"^```python\n(.*?)^```", (pkg.path / "README.md").read_text(), re.M | re.S)
    return match.group(1) if match else None


def check_installed(pkg: Package, by_dist: dict[str, Package], dist_dir: Path, work: Path) -> None:
    """Fresh venv with the wheel and its declared requirements; import, example, CLI."""
    venv = work / f"venv-{pkg.name}"
    shutil.rmtree(venv, ignore_errors=True)
    run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)])
    python = str(venv / "bin" / "python")

    # The ppo-* packages its METADATA declares, transitively, as the wheels just built.
    wheels, todo, seen = [], [pkg.dist], set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        dep = by_dist[dist]
        wheel = dist_dir / f"{dep.stem}-py3-none-any.whl"
        wheels.append(str(wheel))
        todo.extend(n for n, _ in requirements(wheel_metadata(wheel, dep.stem)) if n in by_dist)
    lock = work / f"constraints-{pkg.name}.txt"
    export = [UV, "export", "--frozen", "--package", pkg.dist, "--no-dev", "--no-emit-workspace"]
    run([*export, "--no-hashes", "--no-header", "--quiet", "--output-file", str(lock)])
    run([UV, "pip", "install", "--quiet", "--python", python, "-c", str(lock), *wheels])
    run([UV, "pip", "check", "--quiet", "--python", python])

    here = work / f"cwd-{pkg.name}"
    shutil.rmtree(here, ignore_errors=True)
    here.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONSAFEPATH"] = "1"
    env["RAY_USAGE_STATS_ENABLED"] = "0"

    def py(*args: str) -> str:
        return run([python, *args], cwd=here, env=env)

    probe = (
        "import importlib, sys\n"
        f"m = importlib.import_module({pkg.module!r})\n"
        "missing = [n for n in m.__all__ if not hasattr(m, n)]\n"
        "assert not missing, f'__all__ names that do not resolve: {missing}'\n"
        "print(m.__file__); print(getattr(m, '__version__', '')); print(len(m.__all__))\n"
    )
    where, version, count = py("-c", probe).splitlines()[-3:]
    if not Path(where).resolve().is_relative_to(venv.resolve()):
        pkg.problems.append(f"{pkg.module} imported from {where}, not the fresh environment")
    if version and version != pkg.version:
        pkg.problems.append(f"{pkg.module}.__version__ {version} != pyproject {pkg.version}")
    pkg.notes.append(f"{count} public names, __version__ {version or '(none)'}")

    example = readme_example(pkg)
    if pkg.name in README_SKETCH:
        pkg.notes.append(f"README example not run: {README_SKETCH[pkg.name]}")
    elif example is None and pkg.name not in SMOKE:
        pkg.problems.append("README has no ```python example (nor a SMOKE command)")
    elif example is not None:
        doctest = ">>>" in example
        script = here / ("example.txt" if doctest else "example.py")
        script.write_text(example)
        if doctest:
            py("-m", "doctest", "-o", "ELLIPSIS", script.name)
        else:
            py(script.name)
        pkg.notes.append(f"README example ran ({'doctest' if doctest else 'script'})")

    scripts = tomllib.loads((pkg.path / "pyproject.toml").read_text())["project"].get("scripts", {})
    commands = [[name, "--help"] for name in scripts] + SMOKE.get(pkg.name, [])
    for cmd in commands:
        run(cmd, cwd=here, env=env)
    if commands:
        pkg.notes.append("ran " + "; ".join(" ".join(c) for c in commands))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", help="directory names (default: every member)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "check")
    args = parser.parse_args()
    packages = members()
    by_dist = {p.dist: p for p in packages}
    unknown = set(args.packages) - {p.name for p in packages}
    if unknown:
        parser.error(f"unknown package(s) {sorted(unknown)}; have {[p.name for p in packages]}")
    wanted = [p for p in packages if not args.packages or p.name in args.packages]

    work = args.out.resolve()
    dist_dir = work / "dist"
    shutil.rmtree(dist_dir, ignore_errors=True)
    start = time.monotonic()
    run([UV, "build", "--all-packages", "--no-sources", "--quiet", "--out-dir", str(dist_dir)])
    print(f"built {len(packages)} sdists and wheels in {time.monotonic() - start:.1f} s")

    for pkg in wanted:
        start = time.monotonic()
        try:
            if check_archives(pkg, dist_dir) is not None:
                check_installed(pkg, by_dist, dist_dir, work)
        except RuntimeError as exc:
            pkg.problems.append(str(exc))
        status = "FAIL" if pkg.problems else "ok"
        print(f"{pkg.dist} {pkg.version}: {status} ({time.monotonic() - start:.1f} s)")
        for line in pkg.notes:
            print(f"    {line}")
        for line in pkg.problems:
            print(f"    PROBLEM: {line}")
    failed = [p.dist for p in wanted if p.problems]
    if failed:
        print(f"check_dist: {len(failed)} package(s) failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
