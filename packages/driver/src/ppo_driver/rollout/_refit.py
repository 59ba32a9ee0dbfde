"""Weight refit: actor rank 0 -> every engine.

Transport: a private torch.distributed process group (gloo on CPU, NCCL on GPU) made
from its own TCP store, so it never touches the trainer's default group. One refit is a
JSON header (version + bucket layout) followed by one flat byte buffer per bucket, each
at most ``bucket_bytes`` (a tensor larger than that travels alone). Fallback: a
safetensors directory (:func:`save_weights_to_disk` / :func:`load_weights_from_disk`).

The sender runs inside the actor's process: :class:`WeightRefitter` calls
:func:`sender_connect` / :func:`sender_broadcast` there through Ray's ``__ray_call__``
(they receive the actor instance and use its ``export_weights()``).

Every socket listens on the group's address only (``127.0.0.1`` by default): the store
is handed a socket bound here (torch's own would listen on every interface) and gloo's
transport binds the address it is given.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from ppo_trainer import host_bound_tcp_store
from safetensors.torch import load_file, save_file

from ._types import ActorRef

if TYPE_CHECKING:  # torch.distributed's stubs do not export it
    from torch._C._distributed_c10d import Store

_log = logging.getLogger(__name__)
_c10d: Any = dist  # the c10d classes used here are not in torch.distributed's stubs

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPE_NAMES.items():
        if d == dtype:
            return name
    raise ValueError(f"refit: tensors of dtype {dtype} are not supported")


def plan_buckets(sizes: Sequence[int], *, bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices, in order, into buckets of at most ``bucket_bytes`` bytes;
    a tensor larger than the bound gets a bucket of its own. Pure.

    >>> plan_buckets([4, 4, 4, 10, 1], bucket_bytes=8)
    [[0, 1], [2], [3], [4]]
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: use a positive byte count")
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        buckets.append(current)
    return buckets


# -- process groups ---------------------------------------------------------------------


@dataclass(slots=True)
class RefitGroup:
    """A private process group: rank 0 sends, ranks 1.. receive."""

    pg: Any
    rank: int
    world_size: int
    device: torch.device
    store: Any

    def close(self) -> None:
        """Tear the group down now. NCCL: ``shutdown()`` (what ``destroy_process_group``
        does), ``abort()`` if that fails; dropped without either, the communicator is
        aborted by its destructor on whatever thread lets go of it, with a warning, and
        a failure there (a peer that died) ends the process instead of raising. Gloo
        holds sockets only: dropping it closes them."""
        if self.device.type != "cuda":
            return
        try:
            self.pg.shutdown()
        except Exception:  # a peer gone, a timeout: abort instead
            _log.warning("refit group: NCCL shutdown failed; aborting it", exc_info=True)
            try:
                self.pg.abort()
            except Exception:
                _log.warning("refit group: NCCL abort failed too", exc_info=True)


def open_store(*, host: str, world_size: int, timeout_s: float) -> tuple[Store, int]:
    """The master TCP store (rank 0) on a free port of ``host``, listening there only
    (``ppo_trainer.host_bound_tcp_store``); returns (store, port)."""
    return host_bound_tcp_store(host, 0, world_size, timeout=datetime.timedelta(seconds=timeout_s))


def connect_group(
    *,
    store: Store | None,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float = 120.0,
    local_addr: str | None = None,
) -> RefitGroup:
    """Join the group (blocks until all ``world_size`` ranks joined). ``local_addr``:
    the address this rank's gloo transport binds (default ``master_addr``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = _c10d.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    if backend == "gloo":
        opts = _c10d.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [_c10d.ProcessGroupGloo.create_device(hostname=local_addr or master_addr)]
        pg: Any = _c10d.ProcessGroupGloo(store, rank, world_size, opts)
        device = torch.device("cpu")
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("refit backend='nccl' needs CUDA; use backend='gloo' on CPU")
        nccl_opts = _c10d.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        pg = _c10d.ProcessGroupNCCL(store, rank, world_size, nccl_opts)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise ValueError(f"refit backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    group = RefitGroup(pg=pg, rank=rank, world_size=world_size, device=device, store=store)
    if backend == "nccl":
        # NCCL connects at a group's first collective: one here makes joining the group
        # the rendezvous (as gloo's constructor is), so an engine that is missing fails
        # set-up, not the first refit. Every rank calls this once per group.
        _broadcast(group, torch.zeros(1, device=device))
    return group


def _broadcast(group: RefitGroup, tensor: torch.Tensor) -> None:
    opts = _c10d.BroadcastOptions()
    opts.rootRank = 0
    group.pg.broadcast([tensor], opts).wait()


# -- wire format ------------------------------------------------------------------------


def broadcast_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    group: RefitGroup,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[str, float]:
    """Send ``state_dict`` (any device) to every other rank of ``group``; rank 0 only.
    Returns ``{"bytes", "buckets", "seconds"}``."""
    if group.rank != 0:
        raise ValueError(f"broadcast_state_dict runs on rank 0, not rank {group.rank}")
    start = time.perf_counter()
    names = list(state_dict)
    tensors = [state_dict[n].detach() for n in names]
    sizes = [t.numel() * t.element_size() for t in tensors]
    buckets = plan_buckets(sizes, bucket_bytes=bucket_bytes)
    header = {
        "version": int(version),
        "tensors": [
            {"name": n, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
            for n, t in zip(names, tensors, strict=True)
        ],
        "buckets": buckets,
    }
    raw = json.dumps(header).encode()
    _broadcast(group, torch.tensor([len(raw)], dtype=torch.int64, device=group.device))
    _broadcast(group, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device))
    for bucket in buckets:
        flat = torch.cat(
            [tensors[i].to(group.device).contiguous().reshape(-1).view(torch.uint8) for i in bucket]
        )
        _broadcast(group, flat)
    return {
        "bytes": float(sum(sizes)),
        "buckets": float(len(buckets)),
        "seconds": time.perf_counter() - start,
    }


def receive_state_dict(
    *, group: RefitGroup, device: str | torch.device | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one :func:`broadcast_state_dict`; returns (version, tensors on ``device``,
    default the group's). With another ``device`` (the host, for an engine that loads
    the weights into its model bucket by bucket) each bucket is moved there as it
    arrives, so the group's device holds one bucket at a time."""
    target = torch.device(device) if device is not None else group.device
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    _broadcast(group, length)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    _broadcast(group, raw)
    header = json.loads(bytes(raw.cpu().tolist()).decode())
    specs = header["tensors"]
    out: dict[str, torch.Tensor] = {}
    for bucket in header["buckets"]:
        shapes = [tuple(specs[i]["shape"]) for i in bucket]
        dtypes = [_DTYPE_NAMES[specs[i]["dtype"]] for i in bucket]
        nbytes = [
            int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size()
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=group.device)
        _broadcast(group, flat)
        offset = 0
        for i, shape, dtype, nb in zip(bucket, shapes, dtypes, nbytes, strict=True):
            # bytes first, then the dtype: the tensors lie back to back, so one may start
            # at an offset its dtype cannot view (a float32 after a bfloat16[5]); the copy
            # (needed anyway, to free the bucket) starts at 0
            part = flat[offset : offset + nb]
            part = part.clone() if target == flat.device else part.to(target)
            out[specs[i]["name"]] = part.view(dtype).reshape(shape)
            offset += nb
    return int(header["version"]), out


# -- the sender side, run in the actor's process via ``actor.__ray_call__`` --------------


class WeightSource(Protocol):
    """The actor process's worker as the senders see it (``ppo_driver.workers``' host):
    ``export_weights()`` is a collective over the group; the source rank returns the
    weights (HF names, CPU tensors), the others ``None``."""

    def export_weights(self) -> dict[str, torch.Tensor] | None: ...


def _exported(worker: WeightSource) -> dict[str, torch.Tensor]:
    """``worker.export_weights()`` on the source rank (rank 0 of the actor group)."""
    weights = worker.export_weights()
    if weights is None:
        raise RuntimeError("refit: export_weights() returned nothing on the sending rank")
    return weights


_SENDERS: dict[str, tuple[Store, RefitGroup | None]] = {}
# The last broadcast per refitter (its base group name): (version, CPU tensors), kept in
# the actor's host memory to bring a restarted engine back (WeightRefitter.restore_engine).
_LAST_SENT: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}


def sender_open(
    _worker: object, *, group_name: str, host: str, world_size: int, timeout_s: float
) -> int:
    """Open the master store for ``group_name`` in this process; returns its port."""
    if group_name in _SENDERS:
        _log.info("refit group %r re-opened; closing the old one", group_name)
        sender_close(_worker, group_name=group_name)
    store, port = open_store(host=host, world_size=world_size, timeout_s=timeout_s)
    _SENDERS[group_name] = (store, None)
    return port


def sender_connect(
    _worker: object, *, group_name: str, host: str, world_size: int, backend: str, timeout_s: float
) -> None:
    """Join ``group_name`` as rank 0 (blocks until every engine joined)."""
    store, _ = _SENDERS[group_name]
    group = connect_group(
        store=store,
        master_addr=host,
        master_port=0,
        rank=0,
        world_size=world_size,
        backend=backend,
        timeout_s=timeout_s,
    )
    _SENDERS[group_name] = (store, group)


def _connected(group_name: str) -> RefitGroup:
    _, group = _SENDERS[group_name]
    if group is None:
        raise RuntimeError(f"refit group {group_name!r} is not connected; call setup() first")
    return group


def sender_broadcast(
    worker: WeightSource,
    *,
    group_name: str,
    version: int,
    bucket_bytes: int,
    keep_as: str | None = None,
) -> dict[str, float]:
    """Broadcast ``worker.export_weights()`` as ``version`` over ``group_name``.
    ``keep_as``: keep the exported tensors under this key (see :func:`sender_resend`)."""
    group = _connected(group_name)
    if keep_as is not None:
        _LAST_SENT.pop(keep_as, None)  # never two exports in host memory at once
    weights = _exported(worker)
    stats = broadcast_state_dict(weights, group=group, version=version, bucket_bytes=bucket_bytes)
    if keep_as is not None:
        _LAST_SENT[keep_as] = (int(version), weights)
    return stats


def sender_resend(
    _worker: object, *, group_name: str, kept_as: str, version: int, bucket_bytes: int
) -> dict[str, float]:
    """Broadcast the tensors kept by :func:`sender_broadcast` (they must be ``version``)."""
    kept = _LAST_SENT.get(kept_as)
    if kept is None or kept[0] != version:
        raise RuntimeError(
            f"refit: no copy of version {version} is kept in the actor process "
            f"(kept: {None if kept is None else kept[0]})"
        )
    return broadcast_state_dict(
        kept[1], group=_connected(group_name), version=version, bucket_bytes=bucket_bytes
    )


def sender_close(_worker: object, *, group_name: str) -> None:
    """Close ``group_name`` (:meth:`RefitGroup.close`; its store's socket closes)."""
    old = _SENDERS.pop(group_name, None)
    if old is not None and old[1] is not None:
        old[1].close()


def peer_export(worker: WeightSource) -> None:
    """A non-source rank's part of the export collective (Megatron gathers the HF
    weights over its tensor/pipeline ranks): every rank of the actor group exports,
    only rank 0 sends."""
    worker.export_weights()


def sender_save(worker: WeightSource, *, path: str, version: int) -> str:
    """Write ``worker.export_weights()`` to a safetensors directory."""
    return save_weights_to_disk(_exported(worker), path, version=version)


# -- disk fallback ------------------------------------------------------------------------


def save_weights_to_disk(
    state_dict: Mapping[str, torch.Tensor], path: str | Path, *, version: int
) -> str:
    """Write ``model.safetensors`` + ``refit.json`` (the version) into directory ``path``
    (aside, then renamed). Tied tensors are stored once per name (cloned)."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    tmp = d / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"version": str(version)})
    os.replace(tmp, d / "model.safetensors")
    (d / "refit.json.tmp").write_text(json.dumps({"version": int(version)}))
    os.replace(d / "refit.json.tmp", d / "refit.json")
    return str(d)


def load_weights_from_disk(path: str | Path) -> tuple[int, dict[str, torch.Tensor]]:
    d = Path(path)
    version = int(json.loads((d / "refit.json").read_text())["version"])
    return version, load_file(str(d / "model.safetensors"))


# -- what an engine's checkpoint holds -------------------------------------------------------

_TIED_HEAD = "lm_head.weight"
"""The output head's name, absent from (or ignored in) a checkpoint whose config ties it
to the input embedding (``tie_word_embeddings``)."""


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """The tensors a Hugging Face checkpoint directory holds (names -> shapes, read from
    the safetensors headers: no tensor is loaded), and whether its config ties the
    output head to the input embedding."""

    shapes: Mapping[str, tuple[int, ...]]
    tied: bool = False

    def mismatch(self, sent: Mapping[str, Sequence[int]]) -> str | None:
        """What is wrong with a refit of tensors of these shapes (name -> shape) for a
        model loaded from this checkpoint (``None``: nothing): names it does not hold,
        names it holds that the refit lacks (their weights would stay the old ones),
        shapes that differ. A tied head may be sent or not."""
        expected = {n: s for n, s in self.shapes.items() if not (self.tied and n == _TIED_HEAD)}
        given = {n: tuple(s) for n, s in sent.items() if not (self.tied and n == _TIED_HEAD)}
        unknown = sorted(set(given) - set(expected))
        missing = sorted(set(expected) - set(given))
        shapes = [
            f"{n} {list(given[n])} (the checkpoint's {list(expected[n])})"
            for n in sorted(set(given) & set(expected))
            if given[n] != expected[n]
        ]
        problems = [
            f"{label} {len(items)}: {', '.join(items[:4])}{', ...' if len(items) > 4 else ''}"
            for label, items in (("unknown", unknown), ("missing", missing), ("shape", shapes))
            if items
        ]
        return "; ".join(problems) or None


def checkpoint_layout(path: str | Path) -> CheckpointLayout | None:
    """The :class:`CheckpointLayout` of the Hugging Face directory ``path``: its
    ``model.safetensors`` or the shards its ``model.safetensors.index.json`` names.
    ``None`` when the directory holds no safetensors (a ``.bin`` checkpoint, or no
    local directory): then nothing can be checked."""
    from safetensors import safe_open

    d = Path(path)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(st.get_slice(name).get_shape())
    # without the key, transformers' own default (PretrainedConfig): tied
    config = d / "config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    return CheckpointLayout(shapes=shapes, tied=bool(settings.get("tie_word_embeddings", True)))


# -- driver side ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RefitStats:
    version: int
    bytes: int
    buckets: int
    seconds: float
    transport: str


class WeightRefitter:
    """Pushes the actor's weights (rank 0, a Ray actor with ``export_weights()``) to
    every engine (Ray actors implementing :class:`RolloutEngine`).

    The export is a collective over the actor group: ``peers`` (the group's other
    ranks) run their part of it (:func:`peer_export`) alongside rank 0, which alone
    sends.

    ``refit(version=...)`` re-creates the group first when an engine was restarted
    since ``setup()`` (its incarnation changed), so a dead engine never wedges a refit.

    A restarted engine comes back with the weights it was built with and generates
    nothing until it is brought up to date (:class:`EngineRestarted`):
    :meth:`restore_engine` (the rollout manager's ``on_engine_restart``) pushes the last
    refit's version to it alone. Its source: the safetensors snapshot that every refit
    leaves in ``snapshot_dir`` when one is given (a disk write per refit), else a copy
    of the last broadcast kept in the actor process's host memory (one model's worth of
    CPU memory; ``export_weights()`` must return tensors it does not modify later, as
    both ppo_trainer backends do: fresh CPU copies).
    """

    def __init__(
        self,
        *,
        actor: ActorRef,
        engines: Sequence[ActorRef],
        peers: Sequence[ActorRef] = (),
        backend: str = "gloo",
        master_addr: str = "127.0.0.1",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group_name: str = "ppo_refit",
        timeout_s: float = 120.0,
        snapshot_dir: str | Path | None = None,
    ) -> None:
        if not engines:
            raise ValueError("WeightRefitter needs at least one engine")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"refit backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: use a positive byte count")
        self.actor = actor
        self.peers = list(peers)
        self.engines = list(engines)
        self.backend = backend
        self.master_addr = master_addr
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.last_version: int | None = None
        self._last_path: Path | None = None  # where last_version lies on disk, if it does
        self._incarnations: list[str] | None = None
        self._generation = 0
        self._restores = 0

    def _name(self) -> str:
        return f"{self.group_name}.{self._generation}"

    def _connect(self, name: str, engines: Sequence[ActorRef]) -> None:
        """A group named ``name``: the actor rank 0, ``engines[i]`` rank ``i + 1``."""
        import ray

        world = len(engines) + 1
        kw = {"group_name": name, "host": self.master_addr, "world_size": world}
        port = ray.get(self.actor.__ray_call__.remote(sender_open, timeout_s=self.timeout_s, **kw))
        joins = [
            e.init_refit_group.remote(
                master_addr=self.master_addr,
                master_port=port,
                rank=i + 1,
                world_size=world,
                backend=self.backend,
                group_name=name,
            )
            for i, e in enumerate(engines)
        ]
        sender = self.actor.__ray_call__.remote(
            sender_connect, backend=self.backend, timeout_s=self.timeout_s, **kw
        )
        ray.get([sender, *joins])

    def _close(self, name: str, engines: Sequence[ActorRef]) -> None:
        import ray

        ray.get(
            [
                self.actor.__ray_call__.remote(sender_close, group_name=name),
                *[e.close_refit_group.remote(group_name=name) for e in engines],
            ]
        )

    def setup(self) -> None:
        """Create the process group (actor rank 0, engine i rank i + 1); the previous
        one, if any, is closed."""
        import ray

        if self._generation:
            self._close(self._name(), self.engines)
        self._generation += 1
        self._connect(self._name(), self.engines)
        self._incarnations = [
            h.incarnation for h in ray.get([e.health.remote() for e in self.engines])
        ]

    def _engines_restarted(self) -> bool:
        import ray

        now = [h.incarnation for h in ray.get([e.health.remote() for e in self.engines])]
        return now != self._incarnations

    def refit(self, *, version: int) -> RefitStats:
        """Broadcast the actor's current weights as ``version``; returns once every
        engine holds them (each applies them between two groups)."""
        import ray

        if self._incarnations is None or self._engines_restarted():
            self.setup()
        start = time.perf_counter()
        receives = [e.receive_weights.remote(group_name=self._name()) for e in self.engines]
        send = self.actor.__ray_call__.remote(
            sender_broadcast,
            group_name=self._name(),
            version=version,
            bucket_bytes=self.bucket_bytes,
            keep_as=None if self.snapshot_dir is not None else self.group_name,
        )
        joins = [p.__ray_call__.remote(peer_export) for p in self.peers]
        stats, *versions = ray.get([send, *receives])
        ray.get(joins)
        if any(v != version for v in versions):
            raise RuntimeError(f"refit to version {version}: engines report {versions}")
        self.last_version, self._last_path = version, None
        if self.snapshot_dir is not None:
            ray.get(
                [
                    self.actor.__ray_call__.remote(
                        sender_save, path=str(self.snapshot_dir), version=version
                    ),
                    *[p.__ray_call__.remote(peer_export) for p in self.peers],
                ]
            )
            self._last_path = self.snapshot_dir
        return RefitStats(
            version=version,
            bytes=int(stats["bytes"]),
            buckets=int(stats["buckets"]),
            seconds=time.perf_counter() - start,
            transport=self.backend,
        )

    def refit_from_disk(self, *, version: int, path: str | Path) -> RefitStats:
        """The fallback: the actor writes a safetensors directory, every engine loads it
        (a restarted engine is restored from there until the next refit)."""
        import ray

        start = time.perf_counter()
        ray.get(
            [
                self.actor.__ray_call__.remote(sender_save, path=str(path), version=version),
                *[p.__ray_call__.remote(peer_export) for p in self.peers],
            ]
        )
        versions = ray.get(
            [e.update_weights_from_disk.remote(str(path), version=version) for e in self.engines]
        )
        if any(v != version for v in versions):
            raise RuntimeError(f"disk refit to version {version}: engines report {versions}")
        self.last_version, self._last_path = version, Path(path)
        if self.snapshot_dir is not None and Path(path) != self.snapshot_dir:
            ray.get(
                [
                    self.actor.__ray_call__.remote(
                        sender_save, path=str(self.snapshot_dir), version=version
                    ),
                    *[p.__ray_call__.remote(peer_export) for p in self.peers],
                ]
            )
            self._last_path = self.snapshot_dir
        size = (Path(path) / "model.safetensors").stat().st_size
        return RefitStats(
            version=version,
            bytes=size,
            buckets=1,
            seconds=time.perf_counter() - start,
            transport="disk",
        )

    def restore_engine(self, index: int, engine: ActorRef) -> None:
        """Bring a restarted engine to the last refit's version (before any refit: its
        initial weights are current, and it is told so). Only this engine takes part;
        the refit group itself is re-created at the next :meth:`refit`."""
        import ray

        if self.last_version is None:
            ray.get(engine.confirm_weights.remote(version=0))
            return
        if self._last_path is not None:
            version = ray.get(
                engine.update_weights_from_disk.remote(
                    str(self._last_path), version=self.last_version
                )
            )
        else:
            self._restores += 1
            name = f"{self.group_name}.restore{self._restores}"
            self._connect(name, [engine])
            try:
                receive = engine.receive_weights.remote(group_name=name)
                send = self.actor.__ray_call__.remote(
                    sender_resend,
                    group_name=name,
                    kept_as=self.group_name,
                    version=self.last_version,
                    bucket_bytes=self.bucket_bytes,
                )
                version, _ = ray.get([receive, send])  # a dead engine's error first
            finally:
                self._close(name, [engine])
        if version != self.last_version:
            raise RuntimeError(
                f"restoring engine {index} to version {self.last_version}: it reports {version}"
            )
        _log.info("engine %d restored to weight version %d", index, version)
