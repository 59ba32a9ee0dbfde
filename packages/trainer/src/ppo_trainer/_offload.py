"""Host-copy offload of a torch module + optimizer (the torch backend's sleep mechanism).

Offloading a part copies each of its tensors to host memory (pinned when CUDA is
used) and swaps the device tensor for an empty placeholder, so the device memory is
freed and any use while asleep fails loudly. ``onload`` copies everything back
bit-for-bit. Parts not named stay resident: the actor keeps ``GRADIENTS`` between
chunks of one step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ppo_trainer._parts import Part

__all__ = ["HostOffloader"]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t.detach())
    return host


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


class HostOffloader:
    """Moves the chosen parts of ``modules`` and ``optimizers`` to host memory and back."""

    def __init__(
        self, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer] = ()
    ) -> None:
        self._modules = list(modules)
        self._optimizers = list(optimizers)
        self._saved: list[tuple[Part, object, str, torch.Tensor, torch.device]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, parts: frozenset[Part]) -> None:
        assert not self._saved, "offload() twice without onload(): the worker must prevent this"
        for module in self._modules:
            for p in module.parameters():
                if Part.PARAMETERS in parts:
                    self._saved.append((Part.PARAMETERS, p, "data", _to_host(p.data), p.device))
                    p.data = _placeholder(p.data)
                if Part.GRADIENTS in parts and p.grad is not None:
                    self._saved.append((Part.GRADIENTS, p, "grad", _to_host(p.grad), p.device))
                    p.grad = None
            if Part.BUFFERS in parts:
                for b in module.buffers():
                    self._saved.append((Part.BUFFERS, b, "data", _to_host(b.data), b.device))
                    b.data = _placeholder(b.data)
        if Part.OPTIMIZER in parts:
            for opt in self._optimizers:
                for state in opt.state.values():
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            self._saved.append(
                                (Part.OPTIMIZER, state, key, _to_host(value), value.device)
                            )
                            state[key] = _placeholder(value)

    def onload(self) -> None:
        for part, owner, attr, host, device in self._saved:
            restored = host.to(device, non_blocking=host.is_pinned())
            if part is Part.OPTIMIZER:
                assert isinstance(owner, dict)
                owner[attr] = restored
            elif part is Part.GRADIENTS:
                assert isinstance(owner, torch.Tensor)
                owner.grad = restored
            else:
                assert isinstance(owner, torch.Tensor)
                owner.data = restored
        if any(device.type == "cuda" for *_, device in self._saved):
            torch.cuda.synchronize()
        self._saved.clear()
