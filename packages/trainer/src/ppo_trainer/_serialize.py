"""Nested state <-> (safetensors tensors, JSON skeleton): checkpoints without pickle.

``flatten_state`` walks dicts, lists and tuples; every tensor goes to a flat
``{name: tensor}`` map (saved with safetensors) and is replaced in the JSON skeleton by
``{"__tensor__": name}``. Dicts whose keys are not all plain strings, and tuples, are
tagged so ``unflatten_state`` restores them exactly (optimizer states use int keys and
tuple betas). Anything else (an arbitrary object) raises ``TypeError`` naming its path:
nothing is ever pickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["flatten_state", "load_state", "save_state", "unflatten_state"]

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__dtype__")
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def flatten_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` -> ``(skeleton, tensors)``: a JSON-serialisable skeleton and CPU tensors."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = path or "root"
            tensors[name] = value.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            plain = all(isinstance(k, str) and k not in _TAGS for k in value)
            if plain:
                return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
            items = []
            for k, v in value.items():
                if not (k is None or isinstance(k, bool | int | float | str)):
                    raise TypeError(f"state key {k!r} at {path or '/'} is not a JSON scalar")
                items.append([k, walk(v, f"{path}/{k}")])
            return {"__dict__": items}
        raise TypeError(
            f"state value at {path or '/'} has type {type(value).__name__}, which cannot be "
            "saved without pickle; convert it to tensors, dicts, lists and JSON scalars"
        )

    skeleton = walk(obj, "")
    return skeleton, tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten_state``."""
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dtype__" in skeleton:
            return _DTYPES[skeleton["__dtype__"]]
        if "__tuple__" in skeleton:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        if "__dict__" in skeleton:
            return {k: unflatten_state(v, tensors) for k, v in skeleton["__dict__"]}
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    return skeleton


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_state(directory: str | os.PathLike[str], obj: Any, *, stem: str = "state") -> None:
    """Write ``obj`` as ``<stem>.safetensors`` + ``<stem>.json`` under ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    skeleton, tensors = flatten_state(obj)
    _atomic_write(d / f"{stem}.safetensors", lambda p: save_file(tensors, str(p)))
    _atomic_write(
        d / f"{stem}.json", lambda p: p.write_text(json.dumps(skeleton, indent=1), encoding="utf-8")
    )


def load_state(directory: str | os.PathLike[str], *, stem: str = "state") -> Any:
    """Read what ``save_state`` wrote (tensors on the CPU)."""
    d = Path(directory)
    skeleton = json.loads((d / f"{stem}.json").read_text(encoding="utf-8"))
    # load_file's tensors wrap a buffer whose storage cannot be resized; optimizer state
    # and parameters must own theirs so that ppo_lifecycle can release them on sleep().
    tensors = {k: t.clone() for k, t in load_file(str(d / f"{stem}.safetensors")).items()}
    return unflatten_state(skeleton, tensors)
