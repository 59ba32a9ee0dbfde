"""The ``torch`` backend: Hugging Face models, plain torch DDP-by-hand.

Policy and reference: a ``ModelSpec`` without ``path`` builds the Qwen2 architecture
with seeded random weights, in plain torch (``ppo_trainer._qwen2``: transformers'
names, initial values and numerics, without importing transformers); a local HF
directory loads with ``AutoModelForCausalLM`` (safetensors only). Critic: the same architecture as
``AutoModelForTokenClassification`` with ``num_labels=1`` (the base model plus a
``score`` linear head), so a critic export loads back with transformers.
Data parallelism: every rank holds the full model; ``all_reduce_grads`` sums the
flattened gradients over the default process group (gloo on CPU, NCCL on CUDA).
Models stay in eval mode (no dropout), so chunked and full-batch runs agree.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import urllib.parse
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ppo_lifecycle import ALL_PARTS, OffloadManager, Part
from torch import nn

from ppo_trainer._backend import (
    Batch,
    ForwardFn,
    LossFn,
    Mesh,
    lr_multiplier,
    sum_floats_over_ranks,
)
from ppo_trainer._config import ActorConfig, CriticConfig, ModelSpec
from ppo_trainer._offload import (
    CommunicatorSuspender,
    SuspendableComm,
    lifecycle_backend_name,
    nccl_communicators,
    resolve_offload_backend,
)
from ppo_trainer._qwen2 import Qwen2CausalLM, Qwen2Spec, Qwen2TokenValue

__all__ = [
    "TorchBackend",
    "TorchFrozenModel",
    "TorchTrainModel",
    "build_causal_lm",
    "build_value_model",
    "create_backend",
    "resolve_device",
    "save_hf_checkpoint",
]

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_NAMES: Counter[str] = Counter()
_FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW kernel runs


def _model_name(base: str) -> str:
    """``base`` for the first model of that kind in this process, then ``base-1``, ...:
    memory-saver regions are tagged by name and two live models may not share one."""
    n = _MODEL_NAMES[base]
    _MODEL_NAMES[base] += 1
    return base if n == 0 else f"{base}-{n}"


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the current CUDA device when CUDA is available, else the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} is invalid on this machine: no CUDA; use 'cpu' or 'auto'"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _hf_config(spec: ModelSpec, *, num_labels: int | None = None) -> Any:
    """transformers' ``Qwen2Config`` of a spec without ``path`` (imports transformers);
    ``num_labels``: the value model's (its head without dropout)."""
    return Qwen2Spec(**spec.hf_config_kwargs(), num_labels=num_labels).to_hf()


def build_causal_lm(
    spec: ModelSpec, *, device: torch.device | str = "cpu", plain_torch: bool = False
) -> nn.Module:
    """The causal LM of ``spec``: seeded random weights, or ``spec.path`` (safetensors).

    A transformers ``Qwen2ForCausalLM`` (``AutoModelForCausalLM``), unless
    ``plain_torch`` and the spec has no ``path``: then the same architecture in plain
    torch (``ppo_trainer._qwen2``: transformers' parameter names, the same initial values
    bit for bit, the same forward; no ``generate`` or ``save_pretrained``), which does
    not import transformers. The workers and the embedded engine build that one."""
    dtype = _TORCH_DTYPES[spec.dtype]
    if spec.path is None and plain_torch:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            built: nn.Module = Qwen2CausalLM(Qwen2Spec(**spec.hf_config_kwargs()), dtype=dtype)
        return built.to(device).eval()
    from transformers import AutoModelForCausalLM

    if spec.path is not None:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, use_safetensors=True)
        _own_storage(model)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(_hf_config(spec), dtype=dtype)  # type: ignore[no-untyped-call]
    model.config.use_cache = False
    module: nn.Module = model
    return module.to(device).eval()


def _own_storage(model: nn.Module) -> None:
    """Give every tensor loaded from safetensors its own resizable storage (on CPU they
    share the file's read-only mapping, which a sleep cannot release)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()


def build_value_model(
    spec: ModelSpec, *, device: torch.device | str = "cpu", plain_torch: bool = False
) -> nn.Module:
    """The critic of ``spec``: base model + ``score`` head (``num_labels=1``, no dropout);
    transformers' ``Qwen2ForTokenClassification``, or with ``plain_torch`` (and no
    ``path``) the plain-torch twin, as :func:`build_causal_lm`."""
    dtype = _TORCH_DTYPES[spec.dtype]
    if spec.path is None and plain_torch:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 1)
            arch = Qwen2Spec(**spec.hf_config_kwargs(), num_labels=1)
            built: nn.Module = Qwen2TokenValue(arch, dtype=dtype)
        return built.to(device).eval()
    from transformers import AutoConfig, AutoModelForTokenClassification

    if spec.path is not None:
        # a causal-LM checkpoint gets a new head: seeded, so every data-parallel rank and
        # every run draws the same one (a head already in the checkpoint is loaded)
        config = AutoConfig.from_pretrained(spec.path, num_labels=1)
        config.classifier_dropout = 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 1)
            model = AutoModelForTokenClassification.from_pretrained(
                spec.path, config=config, dtype=dtype, use_safetensors=True
            )
        _own_storage(model)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 1)
            config = _hf_config(spec, num_labels=1)
            model = AutoModelForTokenClassification.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    model.config.use_cache = False
    module: nn.Module = model
    return module.to(device).eval()


def save_hf_checkpoint(
    *,
    weights: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    path: str | os.PathLike[str],
    role: str = "policy",
) -> Path:
    """Write ``weights`` (``export_weights()`` of a worker) as a Hugging Face directory.

    ``config.json`` (from ``spec``, or copied from ``spec.path``) plus
    ``model.safetensors``; ``role="critic"`` writes a token-classification config with
    ``num_labels=1``. The result loads with ``ModelSpec(path=...)`` or transformers'
    ``from_pretrained(..., use_safetensors=True)``.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if role not in ("policy", "critic"):
        raise ValueError(f"role={role!r} is invalid: use 'policy' or 'critic'")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(spec.path) if spec.path is not None else _hf_config(spec)
    config.dtype = spec.dtype
    if role == "critic":
        config.num_labels = 1
        config.classifier_dropout = 0.0
        config.architectures = [type(config).__name__.replace("Config", "ForTokenClassification")]
    else:
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(out)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class TorchFrozenModel:
    """A transformers model that only runs forward (also the base of ``TorchTrainModel``)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        kind: str,
        device: torch.device,
        name: str,
        offload_backend: str = "auto",
        optimizer: torch.optim.Optimizer | None = None,
        keep_gradients: bool = False,
    ) -> None:
        self.module = module
        self.kind = kind  # "lm" or "value"
        self.device = device
        self.lifecycle = OffloadManager(
            module,
            optimizer,
            device=device,
            backend=lifecycle_backend_name(offload_backend),  # type: ignore[arg-type]
            name=name,
            keep_gradients=keep_gradients,
        )

    def _run(self, mb: Batch) -> torch.Tensor:
        out = self.module(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])
        logits: torch.Tensor = out.logits
        if self.kind == "value":
            return logits.squeeze(-1).float()
        return logits.float()

    def forward(self, micro_batches: Sequence[Batch], *, fn: ForwardFn) -> list[torch.Tensor]:
        with torch.no_grad():
            return [fn(self._run(mb), mb).detach() for mb in micro_batches]

    def export_hf(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in self.module.state_dict().items()
        }

    def load_hf(self, state: Mapping[str, torch.Tensor]) -> None:
        self.module.load_state_dict(dict(state), strict=True)

    def sleep(self, *, parts: frozenset[Part]) -> None:
        self.lifecycle.sleep(parts=parts)

    def wake_up(self, *, parts: frozenset[Part] = ALL_PARTS) -> None:
        self.lifecycle.wake_up(parts=parts)


class TorchTrainModel(TorchFrozenModel):
    """A trainable transformers model with AdamW and a LambdaLR schedule."""

    def __init__(
        self,
        module: nn.Module,
        *,
        kind: str,
        device: torch.device,
        config: ActorConfig | CriticConfig,
        dp_size: int,
        name: str,
        keep_gradients: bool,
        offload_backend: str | None = None,
    ) -> None:
        self.config = config
        self.dp_size = dp_size
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            # torch's fused kernel (one call per step for all tensors, as the Megatron
            # backend's Adam where Transformer Engine or apex imports): on the CPU the critic's 16 steps a step of the built-in task took
            # 0.22 ms each against 0.75 ms per tensor loop. Other devices: torch's default.
            fused=True if device.type in _FUSED_ADAMW_DEVICES else None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(
                step=step,
                scheduler=config.lr_scheduler,
                warmup_steps=config.warmup_steps,
                decay_steps=config.decay_steps,
                min_lr_ratio=config.min_lr_ratio,
            ),
        )
        super().__init__(
            module,
            kind=kind,
            device=device,
            name=name,
            offload_backend=offload_backend or config.offload_backend,
            optimizer=self.optimizer,
            keep_gradients=keep_gradients,
        )

    def forward_backward(
        self, micro_batches: Sequence[Batch], *, loss_fn: LossFn
    ) -> list[dict[str, float]]:
        metrics = []
        for mb in micro_batches:
            loss, m = loss_fn(self._run(mb), mb)
            torch.autograd.backward(loss)
            metrics.append(m)
        return metrics

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in self.module.named_parameters()
            if p.requires_grad
        }

    def all_reduce_grads(self) -> None:
        if self.dp_size == 1:
            return
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def scale_grads(self, factor: float) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def grad_norm(self) -> float:
        # As clip_grad_norm_ computes it: per tensor in the gradients' dtype, then over
        # the tensors (so it overflows exactly where the clipped update would).
        norms = [torch.linalg.vector_norm(p.grad) for p in self.params if p.grad is not None]
        if not norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def step(self) -> dict[str, float]:
        max_norm = self.config.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm is not None else float("inf")
        )
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": float(norm), "lr": lr}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.export_hf(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self.load_hf(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def tcp_rendezvous_store(init_method: str, *, rank: int, world_size: int) -> Any | None:
    """The store of a ``tcp://HOST:PORT`` rendezvous (``None`` for any other URL).

    Rank 0 hosts it on a socket bound to ``HOST`` alone: torch's own store server (what
    ``init_method=`` starts) listens on every interface whatever the URL says. With a
    loopback ``HOST`` (one machine), gloo and NCCL stay on the loopback interface too
    (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` default to ``lo``; a value already set
    in the environment wins): left alone they listen on the host name's interface."""
    url = urllib.parse.urlsplit(init_method)
    if url.scheme != "tcp":
        return None
    host, port = url.hostname, url.port
    if not host or port is None:
        raise ValueError(f"dist_init_method={init_method!r}: use the form 'tcp://HOST:PORT'")
    if _is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = dist.constants.default_pg_timeout
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)  # type: ignore[attr-defined]
    store, _ = host_bound_tcp_store(host, port, world_size, timeout=timeout)
    return store


def host_bound_tcp_store(
    host: str, port: int, world_size: int, *, timeout: datetime.timedelta
) -> tuple[Any, int]:
    """A master ``TCPStore`` that listens on ``host`` only; ``port`` 0 takes a free one.
    Returns ``(store, port)``.

    torch's store server listens on every interface (``[::]``) whatever ``host`` says;
    handed a socket already bound to ``host`` (``master_listen_fd``, which the store then
    owns and closes) it stays there. Used by the data-parallel rendezvous here and by the
    driver's weight-refit group."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    port = int(sock.getsockname()[1])
    fd = sock.detach()
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
    return store, port


def group_already_initialised(*, rank: int, world_size: int) -> bool:
    """Whether this process already holds the default process group; ``ValueError`` when
    that group's rank or size differ from ``rank`` / ``world_size``."""
    if not dist.is_initialized():
        return False
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(
            f"world_size={world_size}, rank={rank} do not match the process group already "
            f"initialised in this process (world_size={dist.get_world_size()}, "
            f"rank={dist.get_rank()}); use one group layout per process"
        )
    return True


def init_process_group(
    *, rank: int, world_size: int, dist_init_method: str | None, device: torch.device
) -> None:
    """Initialise (or reuse) the default process group for ``world_size > 1``. A
    ``tcp://`` rendezvous listens on its host only (:func:`tcp_rendezvous_store`)."""
    if world_size == 1:
        return
    if group_already_initialised(rank=rank, world_size=world_size):
        return
    if dist_init_method is None:
        raise ValueError(
            f"dist_init_method=None is invalid with world_size={world_size}: pass a "
            "rendezvous address such as 'tcp://10.0.0.1:29500' or 'file:///tmp/pg'"
        )
    store = tcp_rendezvous_store(dist_init_method, rank=rank, world_size=world_size)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=None if store is not None else dist_init_method,
        store=store,
        rank=rank,
        world_size=world_size,
    )


class TorchBackend:
    """The ``torch`` backend on one rank (pure data parallelism).

    ``offload_backend``: ``config.offload_backend`` resolved on this rank's device
    (:func:`ppo_trainer.resolve_offload_backend`: ``auto`` is ``memory_saver`` on CUDA
    with torch_memory_saver installed, ``host_copy`` otherwise). Process groups: the
    data-parallel group is the default one; with NCCL its communicator is suspended
    while the worker sleeps (see :meth:`release_process_groups`).
    """

    name = "torch"

    def __init__(
        self,
        *,
        config: ActorConfig | CriticConfig,
        rank: int,
        world_size: int,
        dist_init_method: str | None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank}, world_size={world_size} are invalid: need 0 <= rank < world_size"
            )
        if config.backend_options:
            raise ValueError(
                f"backend_options={dict(config.backend_options)!r} are not used by the torch "
                "backend: remove them (they are for backend='megatron')"
            )
        self.config = config
        self.device = resolve_device(config.device)
        role = "critic" if isinstance(config, CriticConfig) else "actor"
        self.offload_backend = resolve_offload_backend(
            config.offload_backend,
            device=self.device,
            backend="torch",
            key=f"{role}.offload_backend",
        )
        self.mesh = Mesh(
            rank, world_size, rank, world_size, tp_size=1, pp_size=1, tp_rank=0, pp_rank=0
        )
        init_process_group(
            rank=rank, world_size=world_size, dist_init_method=dist_init_method, device=self.device
        )
        self.communicators = CommunicatorSuspender(self._communicators, name=role)

    def build_policy(self) -> TorchTrainModel:
        module = build_causal_lm(self.config.model, device=self.device, plain_torch=True)
        return TorchTrainModel(
            module,
            kind="lm",
            device=self.device,
            config=self.config,
            dp_size=self.mesh.dp_size,
            name=_model_name("actor"),
            keep_gradients=True,
            offload_backend=self.offload_backend,
        )

    def build_reference(self) -> TorchFrozenModel:
        module = build_causal_lm(self.config.model, device=self.device, plain_torch=True)
        module.requires_grad_(False)
        return TorchFrozenModel(
            module,
            kind="lm",
            device=self.device,
            name=_model_name("reference"),
            offload_backend=self.offload_backend,
        )

    def build_critic(self) -> TorchTrainModel:
        module = build_value_model(self.config.model, device=self.device, plain_torch=True)
        return TorchTrainModel(
            module,
            kind="value",
            device=self.device,
            config=self.config,
            dp_size=self.mesh.dp_size,
            name=_model_name("critic"),
            keep_gradients=False,
            offload_backend=self.offload_backend,
        )

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return sum_floats_over_ranks(values, dp_size=self.mesh.dp_size, device=self.device)

    def _communicators(self) -> list[SuspendableComm]:
        if self.mesh.world_size == 1 or not dist.is_initialized():
            return []
        return nccl_communicators([dist.group.WORLD])

    def release_process_groups(self) -> None:
        """NCCL (CUDA): suspend the data-parallel communicator's device buffers
        (``ncclCommSuspend``, collective: every rank sleeps together), once every model
        of this process is asleep (:class:`ppo_trainer.CommunicatorSuspender`). Gloo
        (CPU) holds no device memory: nothing to release. One rank: no group at all."""
        self.communicators.release()

    def restore_process_groups(self) -> None:
        """Resume what :meth:`release_process_groups` suspended (idempotent)."""
        self.communicators.restore()


def create_backend(
    *,
    config: ActorConfig | CriticConfig,
    rank: int,
    world_size: int,
    dist_init_method: str | None,
) -> TorchBackend:
    """Registry factory of the ``torch`` backend."""
    return TorchBackend(
        config=config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
    )
