"""Checkpoint state of megatron's optimizers: per chained optimizer, the inner torch
optimizer's state, its main (fp32) parameters, its param groups' own entries and
float16's loss scaler; tensors on the CPU, nothing that needs pickle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["load_main_params", "load_optimizer_state", "optimizer_state"]


def _saveable(value: Any) -> bool:
    """What a checkpoint can hold without pickle (``ppo_trainer._serialize``): tensors,
    JSON scalars and tuples / lists of them. Anything else in a param group (none in
    megatron-core 0.16's groups) is left at the restored model's value."""
    if isinstance(value, tuple | list):
        return all(_saveable(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | torch.Tensor)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _group_device(group: Mapping[str, Any]) -> torch.device:
    """The device of a param group's parameters (where its tensor entries live)."""
    params = group["params"]
    return params[0].device if params else torch.device("cpu")


def optimizer_state(chained_optimizers: Sequence[Any]) -> list[dict[str, Any]]:
    """The state of each of megatron's optimizers (inside its ChainedOptimizer)."""
    return [_chained_state(chained) for chained in chained_optimizers]


def _chained_state(chained: Any) -> dict[str, Any]:
    inner = chained.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    state: dict[str, Any] = {}
    for i, p in enumerate(params):
        if p in inner.state:
            state[str(i)] = {
                k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                for k, v in inner.state[p].items()
            }
    # The inner optimizer's parameters are the main (fp32) copies under mixed
    # precision or the distributed optimizer: saved too, so a restore is exact.
    main = {str(i): p.detach().to("cpu", copy=True) for i, p in enumerate(params)}
    # The param groups' own entries (lr, betas, eps, megatron's multipliers, and
    # the step counter that TE's FusedAdam keeps there rather than per parameter)
    # and float16's loss scaler: without them a restore restarts Adam's bias
    # correction and the loss scale.
    groups = [
        {k: _to_cpu(v) for k, v in g.items() if k != "params" and _saveable(v)}
        for g in inner.param_groups
    ]
    scaler = getattr(chained, "grad_scaler", None)
    return {
        "state": state,
        "num_params": len(params),
        "main_params": main,
        "param_groups": groups,
        "grad_scaler": None
        if scaler is None
        else {k: _to_cpu(v) for k, v in scaler.state_dict().items()},
    }


def load_optimizer_state(
    chained_optimizers: Sequence[Any], saved: Sequence[Mapping[str, Any]]
) -> None:
    """Restore what :func:`optimizer_state` saved (all but the main parameters, which
    :func:`load_main_params` copies after megatron reloaded them from the model)."""
    if len(chained_optimizers) != len(saved):
        raise ValueError("checkpoint optimizer layout differs from this model's")
    for chained, one in zip(chained_optimizers, saved, strict=True):
        _load_chained(chained, one)


def _load_chained(chained: Any, saved: Mapping[str, Any]) -> None:
    inner = chained.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    if int(saved["num_params"]) != len(params):
        raise ValueError("checkpoint optimizer layout differs from this model's")
    # Checkpoints written before these entries existed lack them: the groups
    # keep their fresh values and the scaler its initial state, as before.
    groups = saved.get("param_groups")
    if groups is not None:
        if len(groups) != len(inner.param_groups):
            raise ValueError("checkpoint optimizer layout differs from this model's")
        for group, values in zip(inner.param_groups, groups, strict=True):
            group.update({k: _to_device(v, _group_device(group)) for k, v in values.items()})
    scaler = getattr(chained, "grad_scaler", None)
    if scaler is not None and saved.get("grad_scaler") is not None:
        scaler.load_state_dict(dict(saved["grad_scaler"]))
    inner.state.clear()
    group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
    for key, values in saved["state"].items():
        p = params[int(key)]
        step_device = _step_device(p, group_of[id(p)])
        inner.state[p] = {
            k: (
                v.to(step_device if k == "step" else p.device) if isinstance(v, torch.Tensor) else v
            )
            for k, v in values.items()
        }
    _carry_step(inner, saved, group_of)


def _step_device(p: torch.Tensor, group: Mapping[str, Any]) -> torch.device:
    """Where torch's Adam keeps a parameter's ``step`` counter: on the host unless the
    group is ``capturable`` or ``fused`` (as ``torch.optim.Optimizer.load_state_dict``
    places it; a non-capturable step reads a device counter back with a synchronisation
    per parameter)."""
    return p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")


def _carry_step(
    inner: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    group_of: Mapping[int, Mapping[str, Any]],
) -> None:
    """Adam's step counter in the form the restored optimizer keeps it. megatron-core
    builds Transformer Engine's (or apex's) FusedAdam where it imports, torch's AdamW
    otherwise: the fused ones count steps per param group, torch's per parameter. A
    checkpoint written by one and read by the other (a CPU run resumed on a GPU, a GPU
    with Transformer Engine and one without) would restart the bias correction at step
    1 (fused reading torch's) or fail at the first step for want of the per-parameter
    counter (torch reading the fused one's)."""
    group_steps = [float(g["step"]) for g in saved.get("param_groups") or () if "step" in g]
    steps = group_steps + [float(v["step"]) for v in saved["state"].values() if "step" in v]
    if not steps:
        return
    step = max(steps)
    if type(inner).__module__.startswith("torch.optim"):  # per parameter
        for p, state in inner.state.items():
            if state and "step" not in state:
                device = _step_device(p, group_of[id(p)])
                state["step"] = torch.tensor(step, dtype=torch.float32, device=device)
    else:  # per param group (restored above when the checkpoint had it so)
        if not group_steps:
            for group in inner.param_groups:
                group["step"] = int(step)
        for state in inner.state.values():
            state.pop("step", None)


def load_main_params(
    inner_optimizers: Sequence[torch.optim.Optimizer], saved: Sequence[Mapping[str, Any]]
) -> None:
    """Copy the saved main (fp32) parameters into each inner optimizer's parameters."""
    for inner, one in zip(inner_optimizers, saved, strict=True):
        params = [p for g in inner.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            p.copy_(one["main_params"][str(i)].to(dtype=p.dtype, device=p.device))
