"""Run megatron-core on a machine without CUDA (CPU tensors, gloo process groups).

megatron-core 0.16 assumes a GPU in a handful of places that have nothing to do with
the maths: it asks ``torch.cuda.current_device()`` for the device of new tensors,
creates tensors with ``device="cuda"``, makes a communication stream for DDP, keeps
its model-parallel RNG states as CUDA generator states, and ``clip_grads`` asserts
``param.grad.type() == "torch.cuda.FloatTensor"``. Everything else (``GPTModel`` with
the local layer spec, megatron DDP, ``get_megatron_optimizer`` incl. the distributed
optimizer) already works on CPU tensors with gloo.

This module closes those gaps with four shims. They exist ONLY when CUDA is absent:
:func:`cuda_as_cpu` is a no-op context manager whenever ``torch.cuda.is_available()``,
so a GPU run never sees any of this.

1. CUDA no-ops (process-wide, installed once, only without CUDA): ``current_device``
   returns 0, ``set_device`` / ``synchronize`` / ``empty_cache`` / ``manual_seed`` do
   nothing, and ``torch.cuda.Stream`` / ``Event`` / ``stream`` / ``current_stream`` /
   ``default_stream`` are dummies (all work on CPU is synchronous). Without the shim
   these calls raise "Found no NVIDIA driver", so turning the raise into a no-op
   cannot change what working CPU code does; ``torch.cuda.is_available()`` still
   returns False.
2. The model-parallel RNG tracker (megatron's ``CudaRNGStatesTracker``) keeps and
   forks CPU generator states instead of CUDA ones (process-wide, megatron only).
3. A :class:`torch.overrides.TorchFunctionMode` that maps a CUDA device argument
   (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or a bare index, which torch
   reads as a CUDA index) to the CPU, and makes ``Tensor.cuda()`` return the tensor.
   Scoped: active only inside :func:`cuda_as_cpu`.
4. Inside the same mode, ``Tensor.type()`` (no arguments) of a CPU tensor reports
   ``torch.cuda.<X>Tensor``, for the type check in ``megatron.core.optimizer.clip_grads``.

The backend wraps every call into megatron-core (model build, forward, backward,
DDP, optimizer step) in ``with cuda_as_cpu():``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cuda_as_cpu", "install_process_shims", "is_needed"]

_lock = threading.Lock()
_installed = False


def is_needed() -> bool:
    """True when CUDA is absent, i.e. when the shims are applied."""
    return not torch.cuda.is_available()


# --- 1. CUDA no-ops --------------------------------------------------------------------


class _DummyEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is synchronous, so it is always done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        del end_event
        return 0.0


class _DummyStream:
    """Stands in for ``torch.cuda.Stream``: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _DummyEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _DummyStream()


def _make_no_op(name: str) -> Callable[..., None]:
    # A distinct function object per name: torch._dynamo keys its rules by object.
    def no_op(*args: Any, **kwargs: Any) -> None:
        del args, kwargs

    no_op.__name__ = no_op.__qualname__ = f"cpu_shim_{name}"
    return no_op


def _cuda_no_ops() -> dict[str, Any]:
    def stream_context(stream: Any = None) -> contextlib.AbstractContextManager[None]:
        del stream
        return contextlib.nullcontext()

    def current_device() -> int:
        return 0

    def current_stream(device: Any = None) -> _DummyStream:
        del device
        return _DEFAULT_STREAM

    def default_stream(device: Any = None) -> _DummyStream:
        del device
        return _DEFAULT_STREAM

    no_ops = ("set_device", "synchronize", "empty_cache", "manual_seed", "manual_seed_all")
    return {
        **{name: _make_no_op(name) for name in (*no_ops, "set_stream")},
        "current_device": current_device,
        "Stream": _DummyStream,
        "Event": _DummyEvent,
        "stream": stream_context,
        "current_stream": current_stream,
        "default_stream": default_stream,
    }


# --- 2. RNG tracker on CPU generator states -----------------------------------------------


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom  # type: ignore[import-untyped, unused-ignore]

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_ppo_cpu_rng", False):
        return

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """megatron's tracker with named CPU generator states instead of CUDA ones."""

        _ppo_cpu_rng = True

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"rng seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    # initialize_rng_tracker() looks the class up in the module globals at call time.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


def install_process_shims() -> None:
    """Install shims 1 and 2 once per process; does nothing when CUDA is available."""
    global _installed
    if not is_needed():
        return
    with _lock:
        if _installed:
            return
        for name, replacement in _cuda_no_ops().items():
            setattr(torch.cuda, name, replacement)
        _install_cpu_rng_tracker()
        _installed = True


# --- 3 and 4. CUDA device arguments -> CPU, Tensor.type() -> torch.cuda.* -----------------


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # torch reads a bare int device as a CUDA index
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CPU = torch.device("cpu")


class _CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU; see the module docstring (shims 3, 4)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name: str = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Run the body with all four shims when CUDA is absent; a plain no-op otherwise."""
    if not is_needed():
        yield
        return
    install_process_shims()
    with _CudaAsCpuMode():
        yield
