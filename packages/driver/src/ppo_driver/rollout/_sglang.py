"""The sglang engine (optional extra ``ppo-driver[sglang]``, GPU only): the same
:class:`RolloutEngine` protocol over ``sglang.Engine`` (sglang 0.5.x offline API).

Run it as a Ray actor on a rollout GPU bundle (:func:`launch_sglang_engines`, or
``ray.remote(SglangEngine)`` with the bundle's scheduling strategy and ``num_gpus=1``).
Weights arrive over the project's refit group (:class:`WeightRefitter`: NCCL when the
trainer and the engine have GPUs of their own, gloo when they share one) into this
actor's process and are handed to sglang with its weight-update API,
``update_weights_from_tensor`` (CUDA IPC to sglang's scheduler on the same GPU);
sglang's own ``init_weights_update_group`` / ``update_weights_from_distributed`` and
``update_weights_from_disk`` are exposed too. Per-sample seeds go in sglang's
``sampling_seed``; results are bit-reproducible only with
``enable_deterministic_inference=True``.

``sglang.Engine`` drives an asyncio event loop from the thread that calls it, and Ray
runs a threaded actor's calls on a pool of threads: every call into sglang (its
construction included) therefore runs on ONE thread the engine owns.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from ._embedded import engine_actor_options
from ._refit import RefitGroup, connect_group, load_weights_from_disk, receive_state_dict
from ._sampling import sample_seed
from ._types import (
    EngineHealth,
    EngineRestarted,
    FinishReason,
    GroupOutput,
    GroupRequest,
    SampleOutput,
    check_requests,
    check_vouched_version,
    restarted_by_ray,
)

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "SglangEngine needs sglang: install the extra with `uv sync --extra sglang` "
            "(or `pip install 'ppo-driver[sglang]'`) on a CUDA machine"
        ) from exc
    return sglang


def parse_sglang_output(out: Mapping[str, Any]) -> SampleOutput:
    """One sglang ``generate`` result (with ``return_logprob=True``) as a
    :class:`SampleOutput`. Pure; ``meta_info.output_token_logprobs`` holds
    ``(logprob, token_id, text)`` per generated token."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    tokens = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    if not tokens:
        tokens = [int(t) for t in out.get("output_ids", [])]
        logprobs = [0.0] * len(tokens)
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, Mapping) else str(finish)
    matched = finish.get("matched") if isinstance(finish, Mapping) else None
    reason: FinishReason = "stop" if kind == "stop" else "length"
    if reason == "stop" and isinstance(matched, int) and (not tokens or tokens[-1] != matched):
        tokens.append(matched)
        logprobs.append(0.0)
    return SampleOutput(token_ids=tuple(tokens), logprobs=tuple(logprobs), finish_reason=reason)


def materialize_model(model: Any, directory: str | None = None) -> str:
    """A Hugging Face directory sglang can load for ``model``: its ``path`` when it has
    one, else the tiny model of the spec written (``ppo_trainer.save_hf_checkpoint``)
    into ``directory`` (default: a new temporary directory on this node). The same spec
    and seed give the trainer's initial weights, so no refit is needed before the first
    generation."""
    if isinstance(model, str):
        return model
    if getattr(model, "path", None):
        return str(model.path)
    from ppo_trainer import build_causal_lm, save_hf_checkpoint

    out = directory or tempfile.mkdtemp(prefix="ppo-sglang-model-")
    weights = build_causal_lm(model).state_dict()
    save_hf_checkpoint(weights=weights, spec=model, path=out)
    return out


class SglangEngine:
    """:class:`RolloutEngine` over ``sglang.Engine``.

    Args:
        model_path: a local HF model directory (sglang loads it).
        model: instead of ``model_path``: a ``ppo_trainer.ModelSpec`` (its ``path``, or
            its tiny model written to a temporary directory on this node, see
            :func:`materialize_model`).
        run_seed: seeds each sample as in :class:`EmbeddedEngine`.
        engine_id: a name for logs and outputs.
        engine_kwargs: extra ``sglang.Engine`` server arguments (e.g.
            ``mem_fraction_static``, ``enable_deterministic_inference``). Defaults set
            here: ``skip_tokenizer_init=True`` (token ids in and out),
            ``enable_memory_saver=True`` (``release_memory`` needs it),
            ``random_seed=run_seed``, ``log_level="error"``.
    """

    def __init__(
        self,
        *,
        model_path: str | None = None,
        model: Any = None,
        run_seed: int,
        engine_id: str = "sglang",
        weight_version: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        sgl = _import_sglang()
        if (model_path is None) == (model is None):
            raise ValueError("SglangEngine: give exactly one of model_path and model")
        kwargs = {
            "enable_memory_saver": True,
            "random_seed": int(run_seed),
            "log_level": "error",
            "skip_tokenizer_init": True,
        }
        kwargs.update(engine_kwargs)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sglang-{engine_id}")
        path = model_path if model_path is not None else materialize_model(model)
        self.engine = self._call(lambda: sgl.Engine(model_path=path, **kwargs))
        self._closed = False
        self.engine_id = engine_id
        self.run_seed = int(run_seed)
        self.weight_version = int(weight_version)
        self.incarnation = uuid.uuid4().hex
        self.groups_served = 0
        self._lock = threading.Lock()
        self._running = threading.Condition()
        self._busy = 0
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._released = False
        self._groups: dict[str, RefitGroup] = {}
        self._needs_weights = restarted_by_ray()  # see EmbeddedEngine

    def generate(self, requests: Sequence[GroupRequest]) -> list[GroupOutput]:
        """All groups of the call go to sglang as one batch."""
        check_requests(requests)
        if self._needs_weights:
            raise EngineRestarted(
                f"engine {self.engine_id} was restarted by Ray and still holds its initial "
                f"weights (version {self.weight_version}); it generates again once the "
                "driver pushed the current weights (WeightRefitter.restore_engine)"
            )
        while True:
            self._unpaused.wait()
            with self._running:
                if self._unpaused.is_set():
                    self._busy += 1
                    break
        try:
            with self._lock:
                if self._released:
                    raise RuntimeError(
                        f"engine {self.engine_id}: generate() while memory is released"
                    )
                version = self.weight_version
                input_ids: list[list[int]] = []
                sampling: list[dict[str, Any]] = []
                for req in requests:
                    p = req.params
                    for j in range(p.n):
                        input_ids.append(list(req.prompt_ids))
                        sampling.append(
                            {
                                "temperature": p.temperature,
                                "top_p": p.top_p,
                                "max_new_tokens": p.max_new_tokens,
                                "stop_token_ids": list(p.stop_token_ids),
                                "sampling_seed": sample_seed(
                                    run_seed=self.run_seed,
                                    prompt_index=req.prompt_index,
                                    sample_index=j,
                                    weight_version=version,
                                )
                                % (2**31),
                            }
                        )
                raw = self._call(
                    self.engine.generate,
                    input_ids=input_ids,
                    sampling_params=sampling,
                    return_logprob=True,
                )
                self.groups_served += len(requests)
        finally:
            with self._running:
                self._busy -= 1
                self._running.notify_all()
        outputs: list[GroupOutput] = []
        k = 0
        for req in requests:
            samples = tuple(parse_sglang_output(raw[k + j]) for j in range(req.params.n))
            k += req.params.n
            outputs.append(
                GroupOutput(
                    prompt_index=req.prompt_index,
                    prompt_ids=tuple(req.prompt_ids),
                    samples=samples,
                    weight_version=version,
                    engine_id=self.engine_id,
                )
            )
        return outputs

    def pause_generation(self) -> None:
        with self._running:
            self._unpaused.clear()
            while self._busy > 0:
                self._running.wait()

    def continue_generation(self) -> None:
        self._unpaused.set()

    def release_memory(self) -> None:
        with self._lock:
            if self._released:
                _log.info("engine %s: already released", self.engine_id)
                return
            self._call(self.engine.release_memory_occupation)
            self._released = True

    def resume_memory(self) -> None:
        with self._lock:
            if not self._released:
                _log.info("engine %s: already resident", self.engine_id)
                return
            self._call(self.engine.resume_memory_occupation)
            self._released = False

    def health(self) -> EngineHealth:
        return EngineHealth(
            alive=True,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            weight_version=self.weight_version,
            paused=not self._unpaused.is_set(),
            memory_released=self._released,
            groups_served=self.groups_served,
            needs_weights=self._needs_weights,
        )

    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` on the engine's own thread (see the module docstring)."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def _apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> int:
        """Hand ``tensors`` to sglang (``update_weights_from_tensor``): CUDA tensors go by
        CUDA IPC; CPU ones (a gloo refit) are moved to this process's GPU first."""
        if torch.cuda.is_available():
            tensors = {k: v.cuda() if not v.is_cuda else v for k, v in tensors.items()}
        with self._lock:
            self._call(self.engine.update_weights_from_tensor, named_tensors=list(tensors.items()))
            self.weight_version = int(version)
            self._needs_weights = False
        return self.weight_version

    def confirm_weights(self, *, version: int) -> int:
        with self._lock:
            check_vouched_version(self.engine_id, holds=self.weight_version, version=version)
            self._needs_weights = False
        return self.weight_version

    def close_refit_group(self, *, group_name: str) -> None:
        self._groups.pop(group_name, None)

    def init_refit_group(
        self,
        *,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        group_name: str,
    ) -> None:
        local = master_addr
        if master_addr not in ("127.0.0.1", "localhost"):  # another node: bind this one's
            import ray

            local = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self._groups[group_name] = connect_group(
            store=None,
            master_addr=master_addr,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            local_addr=local,
        )

    def receive_weights(self, *, group_name: str) -> int:
        version, tensors = receive_state_dict(group=self._groups[group_name])
        return self._apply(version, tensors)

    def update_weights_from_disk(self, path: str, *, version: int) -> int:
        disk_version, tensors = load_weights_from_disk(path)
        if disk_version != version:
            raise ValueError(
                f"engine {self.engine_id}: {path} holds version {disk_version}, not {version}"
            )
        return self._apply(version, tensors)

    # sglang-native transports, for drivers that speak sglang's own protocol
    def init_weights_update_group(self, **kwargs: Any) -> Any:
        return self._call(self.engine.init_weights_update_group, **kwargs)

    def update_weights_from_distributed(self, *, version: int, **kwargs: Any) -> int:
        with self._lock:
            self._call(self.engine.update_weights_from_distributed, **kwargs)
            self.weight_version = int(version)
            self._needs_weights = False
        return self.weight_version

    def update_weights_from_hf_dir(self, model_path: str, *, version: int) -> int:
        """sglang's ``update_weights_from_disk`` (a full HF model directory)."""
        with self._lock:
            self._call(self.engine.update_weights_from_disk, model_path)
            self.weight_version = int(version)
            self._needs_weights = False
        return self.weight_version

    def shutdown(self) -> None:
        """Stop sglang's processes (idempotent); the actor itself stays until killed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.engine.shutdown)
        finally:
            self._thread.shutdown(wait=False)


def launch_sglang_engines(
    count: int,
    *,
    model: Any,
    run_seed: int,
    scheduling_strategies: Sequence[Any] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 1,
    max_restarts: int = -1,
    max_concurrency: int = 64,
    name_prefix: str = "sglang",
    engine_kwargs: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Start ``count`` :class:`SglangEngine` Ray actors, like
    :func:`launch_embedded_engines`: ``scheduling_strategies[i]`` (a rollout bundle's)
    places engine ``i``; Ray restarts a dead engine (``max_restarts``, ``-1``: always)
    and retries no call in flight (the rollout manager re-dispatches its groups).

    ``model``: a local HF directory, or a ``ppo_trainer.ModelSpec`` (its path, or its
    tiny model written on the engine's node: :func:`materialize_model`).
    ``engine_kwargs``: ``sglang.Engine`` server arguments for every engine.
    """
    import ray

    cls = ray.remote(SglangEngine)
    handles = []
    for i, opts in enumerate(
        engine_actor_options(
            count,
            scheduling_strategies=scheduling_strategies,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=max_restarts,
            max_concurrency=max_concurrency,
        )
    ):
        source = {"model_path": model} if isinstance(model, str) else {"model": model}
        handles.append(
            cls.options(**opts).remote(
                **source,
                run_seed=run_seed,
                engine_id=f"{name_prefix}-{i}",
                **dict(engine_kwargs or {}),
            )
        )
    return handles
