"""Loading: the YAML file, dotted overrides, the typed :class:`DriverConfig` (every
unknown key, wrong type and non-finite float collected, each named), then validation.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ppo_driver.config.problems import (
    ConfigError,
    ConfigProblem,
    ValidationReport,
    _non_finite_problem,
)
from ppo_driver.config.schema import DriverConfig
from ppo_driver.config.validation import validate

T = TypeVar("T")


def default_config_path() -> Path:
    """The default YAML shipped inside the package (the built-in tiny task)."""
    return Path(str(resources.files("ppo_driver").joinpath("configs/default.yaml")))


def _set_dotted(tree: dict[str, Any], key: str, value: object) -> None:
    *path, last = key.split(".")
    node = tree
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def apply_overrides(
    tree: dict[str, Any], overrides: Iterable[str], problems: list[ConfigProblem]
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars) to ``tree`` in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep and item.lower().endswith((".yaml", ".yml")):
            why = "a config file given as an override (overrides look like section.key=value)"
            problems.append(ConfigProblem("--config", item, why, f"pass it as --config {item}"))
            continue
        if not sep or not key or any(not p for p in key.split(".")):
            why = "an override must look like section.key=value"
            fix = "write it as e.g. ppo.num_prompts_per_step=256"
            problems.append(ConfigProblem(key or item, item, why, fix))
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", str(tp))


# The YAML values each plain annotation of the schema accepts (a bool is no int here);
# float is _float's, Any takes anything.
_ACCEPTS: dict[object, Callable[[object], bool]] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    dict: lambda v: isinstance(v, dict),
    Any: lambda v: True,
}


def _float(value: object) -> float | None:
    """``value`` as a float: a number, or a string (YAML 1.1 reads "2e-4", "nan" as one)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _coerce(tp: object, value: object, key: str, problems: list[ConfigProblem]) -> object:
    """Check ``value`` against the annotation ``tp``; record a problem and return None if bad.

    Floats must be finite: NaN and infinity are refused here, for every float key of the
    schema (no range rule downstream has to think about them). ``A | None``: null, or
    an ``A`` (the ``A``'s problem, with "or null" in its fix).
    """
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None
        sub: list[ConfigProblem] = []
        for candidate in inner:
            sub.clear()
            out = _coerce(candidate, value, key, sub)
            if not sub:
                return out
        if len(inner) == 1:
            problems.append(dataclasses.replace(sub[0], fix=f"{sub[0].fix}, or null"))
            return None
        expected = " or ".join(_type_name(a) for a in args)
        problems.append(
            ConfigProblem(key, value, f"expected {expected}", f"set {key} to a value of that type")
        )
        return None
    if tp is float and (number := _float(value)) is not None:
        if math.isfinite(number):
            return number
        problems.append(_non_finite_problem(key, value))
        return None
    accepts = _ACCEPTS.get(typing.get_origin(tp) or tp)
    if accepts is not None and accepts(value):
        return dict(value) if isinstance(value, dict) else value
    problems.append(
        ConfigProblem(
            key,
            value,
            f"expected {_type_name(tp)}, got {type(value).__name__}",
            f"set {key} to a {_type_name(tp)}",
        )
    )
    return None


def _build(
    cls: type[T],
    data: Mapping[str, Any],
    prefix: str,
    problems: list[ConfigProblem],
    base: T | None = None,
) -> T:
    """``cls`` from ``data``: every key left out keeps ``base``'s value (default: the
    section's own defaults). A nested section starts from its parent's default for it,
    so ``critic: {train_micro_batch_size: 64}`` keeps the critic's defaults (its lr is
    not the policy's) instead of the bare ``ModelConfig``'s."""
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (
                f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(names)}"
            )
            problems.append(ConfigProblem(dotted, value, "unknown key", f"remove it ({hint})"))
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                fix = f"write {dotted}: {{...}}"
                problems.append(ConfigProblem(dotted, value, "expected a section (mapping)", fix))
                continue
            child = getattr(base, key)
            kwargs[key] = _build(tp, value, f"{dotted}.", problems, base=child)  # type: ignore[arg-type]
            continue
        before = len(problems)
        out = _coerce(tp, value, dotted, problems)
        if len(problems) == before:
            kwargs[key] = out
    return dataclasses.replace(base, **kwargs)  # type: ignore[type-var]


def _file_problem(src: Path, message: str, fix: str) -> ConfigError:
    return ConfigError([ConfigProblem("--config", str(src), message, fix)])


def _unreadable(src: Path, exc: OSError) -> tuple[str, str]:
    """What is wrong with the config file ``src`` that cannot be read, and the fix."""
    if isinstance(exc, FileNotFoundError):
        return f"the config file {src} does not exist", "check the path given to --config"
    if isinstance(exc, IsADirectoryError):
        return f"{src} is a directory, not a YAML file", "pass the YAML file itself to --config"
    return (
        f"cannot read the config file {src} ({exc.strerror or exc})",
        "make it readable (permissions) or pass another file to --config",
    )


def _read_yaml(src: Path) -> dict[str, Any]:
    """The top-level mapping of the YAML file ``src`` (empty file: ``{}``).

    Raises :class:`ConfigError` naming the file for anything that is not a readable,
    UTF-8, YAML mapping, never a raw ``UnicodeDecodeError`` or ``YAMLError``.
    """
    try:
        text = src.read_text(encoding="utf-8")
    except OSError as exc:  # FileNotFoundError, IsADirectoryError, PermissionError, ...
        raise _file_problem(src, *_unreadable(src, exc)) from exc
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        raise _file_problem(
            src,
            f"the config file {src} is not UTF-8 text (byte 0x{byte} at offset {exc.start})",
            "save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 old.yaml > new.yaml`)",
        ) from exc
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise _file_problem(
            src,
            f"the config file {src} is not valid YAML ({where}{what})",
            "fix the YAML syntax at the line and column shown",
        ) from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise _file_problem(
            src,
            f"the config file {src} holds a YAML {type(loaded).__name__}, not a mapping "
            "of sections",
            "write sections at the top level, e.g. `ppo:` and under it "
            "`  num_prompts_per_step: 16`",
        )
    return loaded


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    check: bool = True,
) -> tuple[DriverConfig, ValidationReport]:
    """Read YAML (the shipped default when ``path`` is None), apply overrides, validate.

    Keys the YAML leaves out take the dataclass defaults (the shipped ``default.yaml``
    lists exactly those, so an empty file and the default file give the same config).
    Returns the config and a report holding every error and warning. With ``check``
    (the default) a report with errors raises :class:`ConfigError` listing all of them.
    A file that cannot be read as a YAML mapping raises :class:`ConfigError` in any case.
    """
    problems: list[ConfigProblem] = []
    src = Path(path) if path is not None else default_config_path()
    loaded = _read_yaml(src)
    apply_overrides(loaded, overrides, problems)
    cfg = _build(DriverConfig, loaded, "", problems)
    report = validate(cfg)
    # A key the coercion step refused kept its default; validate() saw that default.
    report.errors[:0] = problems
    if check:
        report.raise_if_errors()
    return cfg, report
