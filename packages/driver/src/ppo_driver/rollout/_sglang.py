"""The sglang engine (optional extra ``ppo-driver[sglang]``, GPU only): the same
:class:`RolloutEngine` protocol over ``sglang.Engine`` (sglang 0.5.x offline API).

Run it as a Ray actor on a rollout GPU bundle (``ray.remote(SglangEngine)`` with the
bundle's scheduling strategy and ``num_gpus=1``). Weights arrive over the project's
refit group (NCCL) into this actor's process and are handed to sglang with
``update_weights_from_tensor`` (CUDA IPC on the same GPU); sglang's own
``init_weights_update_group`` / ``update_weights_from_distributed`` and
``update_weights_from_disk`` are exposed too. Per-sample seeds go in sglang's
``sampling_seed``; results are bit-reproducible only with
``enable_deterministic_inference=True``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

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


class SglangEngine:
    """:class:`RolloutEngine` over ``sglang.Engine``.

    Args:
        model_path: a local HF model directory (sglang loads it).
        run_seed: seeds each sample as in :class:`EmbeddedEngine`.
        engine_id: a name for logs and outputs.
        engine_kwargs: extra ``sglang.Engine`` server arguments (e.g.
            ``mem_fraction_static``, ``enable_deterministic_inference``).
    """

    def __init__(
        self,
        *,
        model_path: str,
        run_seed: int,
        engine_id: str = "sglang",
        weight_version: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        sgl = _import_sglang()
        kwargs = {"enable_memory_saver": True, "random_seed": int(run_seed), "log_level": "error"}
        kwargs.update(engine_kwargs)
        self.engine = sgl.Engine(model_path=model_path, **kwargs)
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
                raw = self.engine.generate(
                    input_ids=input_ids, sampling_params=sampling, return_logprob=True
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
            self.engine.release_memory_occupation()
            self._released = True

    def resume_memory(self) -> None:
        with self._lock:
            if not self._released:
                _log.info("engine %s: already resident", self.engine_id)
                return
            self.engine.resume_memory_occupation()
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

    def _apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> int:
        with self._lock:
            self.engine.update_weights_from_tensor(named_tensors=list(tensors.items()))
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
        self._groups[group_name] = connect_group(
            store=None,
            master_addr=master_addr,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
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
        return self._apply(version, {k: v.cuda() for k, v in tensors.items()})

    # sglang-native transports, for drivers that speak sglang's own protocol
    def init_weights_update_group(self, **kwargs: Any) -> Any:
        return self.engine.init_weights_update_group(**kwargs)

    def update_weights_from_distributed(self, *, version: int, **kwargs: Any) -> int:
        with self._lock:
            self.engine.update_weights_from_distributed(**kwargs)
            self.weight_version = int(version)
            self._needs_weights = False
        return self.weight_version

    def update_weights_from_hf_dir(self, model_path: str, *, version: int) -> int:
        """sglang's ``update_weights_from_disk`` (a full HF model directory)."""
        with self._lock:
            self.engine.update_weights_from_disk(model_path)
            self.weight_version = int(version)
            self._needs_weights = False
        return self.weight_version

    def shutdown(self) -> None:
        self.engine.shutdown()
