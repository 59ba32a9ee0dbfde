"""The sglang engine (optional extra ``ppo-driver[sglang]``, GPU only): the same
:class:`RolloutEngine` protocol over ``sglang.Engine`` (sglang 0.5.x offline API).

Run it as a Ray actor on a rollout GPU bundle (:func:`launch_sglang_engines`, or
``ray.remote(SglangEngine)`` with the bundle's scheduling strategy and ``num_gpus=1``).
Weights arrive over the project's refit group (:class:`WeightRefitter`: NCCL when the
trainer and the engine have GPUs of their own, gloo when they share one) into this
actor's process and are handed to sglang with its weight-update API,
``update_weights_from_tensor`` (CUDA IPC to sglang's scheduler on the same GPU);
sglang's own ``init_weights_update_group`` / ``update_weights_from_distributed`` and
``update_weights_from_disk`` are exposed too. sglang (0.5.23 and later) loads weights
only inside a weight-update session (``begin_weight_update`` ... ``end_weight_update``)
and reports a refused update as a ``(success, message)`` result, not an exception: every
update here opens and closes the session and checks the result, so a refused update
raises instead of leaving the engine on its old weights under the new version number.

Per-sample seeds go in sglang's ``sampling_seed``, which sglang uses only with
``enable_deterministic_inference=True`` (an ``engine_kwargs`` entry): without it sampling
is unseeded, so neither the per-sample seed nor ``run.seed`` makes sglang's samples
reproducible.

``sglang.Engine`` drives an asyncio event loop from the thread that calls it, and Ray
runs a threaded actor's calls on a pool of threads: every call into sglang (its
construction included) therefore runs on ONE thread the engine owns. Generation calls
are not queued one behind another on it: while any is in flight, that thread runs
sglang's loop, and every ``generate`` call's samples go to sglang as their own request
(``Engine.async_generate``), so concurrent calls are decoded together by sglang's
continuous batching and each call returns when its own samples are done (one group per
call, the driver's default with sglang, gets every group back as it finishes). Weight
updates and memory calls wait for the calls in flight and hold new ones back (a
:class:`_Gate`), so every output carries the version that produced all its samples.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, NotRequired, TypedDict, TypeVar

import torch

from ._embedded import engine_actor_options, started_actor
from ._refit import (
    CheckpointLayout,
    RefitGroup,
    checkpoint_layout,
    connect_group,
    load_weights_from_disk,
    plan_buckets,
    receive_state_dict,
)
from ._sampling import sample_seed
from ._types import (
    ActorRef,
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

if TYPE_CHECKING:
    from ppo_trainer import ModelSpec
    from ray.util.scheduling_strategies import SchedulingStrategyT

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_WEIGHTS = "weights"
"""sglang's memory tag of the model weights (``sglang.srt.constants``); its others are
``kv_cache`` and ``cuda_graph``. ``release_memory_occupation(tags=None)`` releases all."""

_HALF_DTYPES = ("bfloat16", "float16")

IDLE_WAIT_S = 60.0
"""How long a memory release or a weight update waits for sglang's scheduler to go
idle (its ``flush_cache`` succeeds only then) before it fails instead."""

LOAD_BUCKET_BYTES = 512 * 1024 * 1024
"""The default bound of one ``update_weights_from_tensor`` load of a refit (bytes)."""


class SglangWeightUpdateError(RuntimeError):
    """sglang refused a weight update (or the session around it). The engine keeps its
    old ``weight_version`` and generates nothing until a later update succeeds: a
    refused update may have loaded some tensors and not others."""


def _check_sglang_result(result: object, *, call: str, engine_id: str, version: int) -> None:
    """Raise :class:`SglangWeightUpdateError` if ``result`` (sglang's ``(success,
    message)``, or ``(success, message, num_paused_requests)`` for
    ``update_weights_from_disk``) reports a failure; ``None`` (an sglang that reports
    nothing) passes."""
    if result is None:
        return
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, message = result[0], (result[1] if len(result) > 1 else "")
    else:
        ok, message = bool(result), repr(result)
    if not ok:
        raise SglangWeightUpdateError(
            f"engine {engine_id}: sglang's {call} failed while loading weight version "
            f"{version}: {message}. The engine refuses to generate until a weight update "
            "succeeds; see the sglang log of that engine's node (a name or shape the model "
            "does not have, or sglang's memory released, are the usual causes)"
        )


def _on_gpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on this process's GPU (where there is one: sglang loads CUDA tensors by
    IPC); as it is otherwise."""
    return tensor.cuda() if torch.cuda.is_available() and not tensor.is_cuda else tensor


def _import_sglang() -> types.ModuleType:
    try:
        import sglang
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "SglangEngine needs sglang: install the extra with `uv sync --extra sglang` "
            "(or `pip install 'ppo-driver[sglang]'`) on a CUDA machine"
        ) from exc
    module: types.ModuleType = sglang  # untyped here: not installed without the extra
    return module


class SglangGenerationError(RuntimeError):
    """sglang ended a request without finishing it (an abort, or NaN logits)."""


class SglangFinishReason(TypedDict, total=False):
    """sglang's ``meta_info.finish_reason`` object: ``type`` is ``stop``, ``length`` or
    ``abort``; ``matched`` the stop token id (or the matched stop string)."""

    type: str
    matched: int | str | None


class SglangMetaInfo(TypedDict, total=False):
    """The part of sglang's ``meta_info`` read here: ``(logprob, token_id, text)`` per
    generated token, and how the request finished."""

    output_token_logprobs: Sequence[tuple[float, int, str | None]]
    finish_reason: SglangFinishReason | str | None


class SglangOutput(TypedDict):
    """One result of sglang's ``Engine.generate`` (token ids in and out)."""

    meta_info: SglangMetaInfo
    output_ids: NotRequired[list[int]]


class SglangSampling(TypedDict):
    """The sglang ``sampling_params`` of one sample."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: list[int]
    sampling_seed: int


def parse_sglang_output(out: SglangOutput) -> SampleOutput:
    """One sglang ``generate`` result (with ``return_logprob=True``) as a
    :class:`SampleOutput`. Pure; ``meta_info.output_token_logprobs`` holds
    ``(logprob, token_id, text)`` per generated token.

    Only sglang's ``stop`` (a stop token) and ``length`` finishes are samples. An
    ``abort`` (sglang returns the ones without an HTTP status code as results, not
    errors) and a ``stop`` on a matched *string* raise :class:`SglangGenerationError`:
    the driver passes no stop strings, so a string match is sglang's NaN guard
    (``"NaN happened"``: the logits were NaN and the sampled id was replaced), and
    training on either would mislabel a broken sample as a complete or truncated one."""
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
    if kind not in ("stop", "length") or isinstance(matched, str):
        shown = dict(finish) if isinstance(finish, Mapping) else finish
        raise SglangGenerationError(
            f"sglang did not finish a sample: finish_reason={shown!r} after "
            f"{len(tokens)} token(s). An abort "
            "comes from sglang itself (out of memory, a request it refused, a shutdown); "
            "a stop on a matched string means NaN logits (weights that were never loaded, "
            "or diverged): see the engine's sglang log"
        )
    reason: FinishReason = "stop" if kind == "stop" else "length"
    if reason == "stop" and isinstance(matched, int) and (not tokens or tokens[-1] != matched):
        tokens.append(matched)
        logprobs.append(0.0)
    return SampleOutput(token_ids=tuple(tokens), logprobs=tuple(logprobs), finish_reason=reason)


def materialize_model(model: ModelSpec | str, directory: str | None = None) -> str:
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


async def _set(event: asyncio.Event) -> None:
    await event.wait()


class _Gate:
    """A shared/exclusive gate: generation calls pass together (``shared``); weight
    updates and memory calls pass alone (``exclusive``), once the calls in flight are
    done, and a waiting exclusive call holds new shared ones back, so a refit is not
    starved by a stream of generation calls."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            while self._exclusive or self._waiting:
                self._cv.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cv:
                self._shared -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cv.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()


_Request = tuple[list[list[int]], list["SglangSampling"], "Future[list[SglangOutput]]"]


class SglangEngine:
    """:class:`RolloutEngine` over ``sglang.Engine``.

    Args:
        model_path: a local HF model directory (sglang loads it).
        model: instead of ``model_path``: a ``ppo_trainer.ModelSpec`` (its ``path``, or
            its tiny model written to a temporary directory on this node, see
            :func:`materialize_model`).
        run_seed: seeds each sample as in :class:`EmbeddedEngine`.
        engine_id: a name for logs and outputs.
        load_bucket_bytes: a refit is handed to sglang in loads of at most this many
            bytes (a larger tensor goes alone), one session, the cache flushed after
            the last: the GPU holds one load at a time beside the served model.
        engine_kwargs: extra ``sglang.Engine`` server arguments (e.g.
            ``mem_fraction_static``, ``enable_deterministic_inference``). Defaults set
            here: ``skip_tokenizer_init=True`` (token ids in and out),
            ``enable_memory_saver=True`` (``release_memory`` needs it, and raises
            without it: sglang would keep its memory),
            ``enable_weights_cpu_backup`` = ``enable_memory_saver`` (see below),
            ``random_seed=run_seed``, ``log_level="error"``, and with ``model`` a
            ``ModelSpec`` whose ``dtype`` is ``bfloat16`` or ``float16``, ``dtype`` = that
            (the trainer's precision; see below).

    Releasing memory (``release_memory``, while colocated trainers use the GPU) drops
    all of sglang's memory: KV cache, CUDA graphs and weights. sglang keeps the weights'
    *contents* only with ``enable_weights_cpu_backup=True``; without it the weights are
    garbage after ``resume_memory`` until the next refit. The backup is on by default
    wherever the memory saver is, because it is the cheaper side of the trade: it costs
    host memory for one copy of the weights and a device<->host copy of them at each
    release and resume (PCIe, well under a second for a small model; a refit while
    released also copies the old weights back before overwriting them), while the other
    way, a refit after every resume, would resend the whole policy from the trainer
    (over gloo and host memory when colocated) also on steps that trained no policy
    (``ppo.critic_warmup_steps``). Turn it off to save the host memory; the engine
    then refuses to generate after a resume that no refit followed, instead of
    sampling from garbage.

    ``released=True`` starts the engine released and paused, like
    :class:`EmbeddedEngine` (colocated: the trainers are built after it let go).

    A refit while released (the colocated step: release, train, refit, resume) first
    brings back the ``weights`` memory alone, so the update writes to mapped memory;
    ``resume_memory`` then brings back the rest (KV cache, CUDA graphs).

    dtype: sglang's default ``dtype="auto"`` serves a float32 checkpoint (the built-in
    tiny model, and every trainer model the driver builds: its dtype is float32) in
    float16, so engine logprobs are float16 numbers against the trainer's float32
    ones (the importance ratios of the first PPO epoch start slightly off 1). A half
    precision trainer dtype is passed on; float32 is not: sglang's default attention
    backends on CUDA (FlashInfer, FlashAttention) are built for half precision, and
    serving float32 has not been tried here. ``engine_kwargs`` ``dtype`` overrides this
    either way (``float32`` for parity, with an attention backend that supports it).
    """

    def __init__(
        self,
        *,
        model_path: str | None = None,
        model: ModelSpec | None = None,
        run_seed: int,
        engine_id: str = "sglang",
        weight_version: int = 0,
        released: bool = False,
        load_bucket_bytes: int = LOAD_BUCKET_BYTES,
        **engine_kwargs: object,
    ) -> None:
        sgl = _import_sglang()
        if type(load_bucket_bytes) is not int or load_bucket_bytes < 1:
            raise ValueError(
                f"SglangEngine: load_bucket_bytes={load_bucket_bytes!r} must be a positive "
                f"byte count (default {LOAD_BUCKET_BYTES})"
            )
        self._load_bytes = load_bucket_bytes
        if (model_path is None) == (model is None):
            raise ValueError("SglangEngine: give exactly one of model_path and model")
        kwargs: dict[str, object] = {
            "enable_memory_saver": True,
            "random_seed": int(run_seed),
            "log_level": "error",
            "skip_tokenizer_init": True,
        }
        spec_dtype = getattr(model, "dtype", None)
        if spec_dtype in _HALF_DTYPES:
            kwargs["dtype"] = spec_dtype
        kwargs.update(engine_kwargs)
        memory_saver = bool(kwargs["enable_memory_saver"])
        kwargs.setdefault("enable_weights_cpu_backup", memory_saver)
        if released and not memory_saver:  # before sglang starts
            raise ValueError(
                f"SglangEngine {engine_id}: released=True (colocated) needs "
                "enable_memory_saver: without it sglang cannot release its GPU memory; "
                "remove enable_memory_saver=False from rollout.engine_kwargs"
            )
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sglang-{engine_id}")
        path = materialize_model(model) if model is not None else str(model_path)
        self.engine = self._call(lambda: sgl.Engine(model_path=path, **kwargs))
        self._model_path = path
        self._layout: CheckpointLayout | None = checkpoint_layout(path)
        self._loop = self._call(self._engine_loop)
        self._queue: list[_Request] = []  # generate calls not yet handed to sglang
        self._queue_lock = threading.Lock()
        self._serving = False  # the sglang thread runs (or will run) _serve
        self._wake: asyncio.Event | None = None
        self._closed = False
        self.engine_id = engine_id
        self.run_seed = int(run_seed)
        self.weight_version = int(weight_version)
        self.incarnation = uuid.uuid4().hex
        self.groups_served = 0
        self._gate = _Gate()
        self._running = threading.Condition()
        self._busy = 0
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._weights_backup = bool(kwargs["enable_weights_cpu_backup"])
        self._memory_saver = memory_saver
        self._released = False  # release_memory ran and resume_memory has not yet
        self._weights_released = False  # ... and the weights memory is still released
        # why generate refuses (weights lost or half-loaded), until an update succeeds
        self._broken_weights: str | None = None
        self._groups: dict[str, RefitGroup] = {}
        self._needs_weights = restarted_by_ray()  # see EmbeddedEngine
        if released and not self._needs_weights:  # see EmbeddedEngine's ``released``
            self.pause_generation()
            self.release_memory()

    def _engine_loop(self) -> asyncio.AbstractEventLoop:
        """On the sglang thread: the event loop sglang's engine drives (sglang 0.5.x keeps
        it as ``Engine.loop``; an older one uses the thread's current loop, made here if
        the thread has none)."""
        loop: asyncio.AbstractEventLoop | None = getattr(self.engine, "loop", None)
        if loop is None:
            try:
                loop = asyncio.get_event_loop()
            except RuntimeError:  # no current loop on this thread
                loop = asyncio.new_event_loop()
                asyncio.set_event_loop(loop)
        return loop

    def generate(self, requests: Sequence[GroupRequest]) -> list[GroupOutput]:
        """All groups of the call go to sglang as one request, beside those of the other
        calls in flight (see the module docstring)."""
        check_requests(requests)
        if self._needs_weights:
            raise EngineRestarted(
                f"engine {self.engine_id} was restarted by Ray and still holds its initial "
                f"weights (version {self.weight_version}); it generates again once the "
                "driver pushed the current weights (WeightRefitter.restore_engine)"
            )
        self._enter_generation()
        try:
            with self._gate.shared():
                if self._released:
                    raise RuntimeError(
                        f"engine {self.engine_id}: generate() while memory is released"
                    )
                if self._broken_weights is not None:
                    raise RuntimeError(
                        f"engine {self.engine_id}: generate() refused: {self._broken_weights}"
                    )
                version = self.weight_version
                input_ids, sampling = self._batch(requests, version=version)
                raw = self._submit(input_ids, sampling).result()
                with self._queue_lock:
                    self.groups_served += len(requests)
        finally:
            with self._running:
                self._busy -= 1
                self._running.notify_all()
        return self._group_outputs(requests, raw, version=version)

    def _submit(
        self, input_ids: list[list[int]], sampling: list[SglangSampling]
    ) -> Future[list[SglangOutput]]:
        """Queue one request for sglang; the sglang thread serves the queue while any
        request is queued or in flight (:meth:`_serve`)."""
        done: Future[list[SglangOutput]] = Future()
        with self._queue_lock:
            self._queue.append((input_ids, sampling, done))
            start, self._serving = not self._serving, True
        if start:
            self._thread.submit(self._serve)
        else:  # _serve is running or about to: wake it if it waits for its requests
            self._loop.call_soon_threadsafe(self._poke)
        return done

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _serve(self) -> None:
        """On the sglang thread: run sglang's loop until no request is queued or in
        flight. A failure of the loop itself fails the requests still queued."""
        try:
            self._loop.run_until_complete(self._serve_queue())
        except BaseException as exc:
            with self._queue_lock:
                queued, self._queue, self._serving = self._queue, [], False
            for *_, done in queued:
                done.set_exception(exc)
            raise

    async def _serve_queue(self) -> None:
        wake = self._wake = asyncio.Event()
        running: set[asyncio.Future[None]] = set()
        while True:
            with self._queue_lock:
                taken, self._queue = self._queue, []
                if not taken and not running:
                    self._serving = False
                    self._wake = None
                    return
            running |= {asyncio.ensure_future(self._one(*request)) for request in taken}
            wake.clear()
            woken = asyncio.ensure_future(_set(wake))
            await asyncio.wait([*running, woken], return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            running = {task for task in running if not task.done()}

    async def _one(
        self,
        input_ids: list[list[int]],
        sampling: list[SglangSampling],
        done: Future[list[SglangOutput]],
    ) -> None:
        try:
            raw: list[SglangOutput] = await self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling, return_logprob=True
            )
        except BaseException as exc:
            done.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        done.set_result(raw)

    def _enter_generation(self) -> None:
        """Wait until generation is not paused, then count this call as running."""
        while True:
            self._unpaused.wait()
            with self._running:
                if self._unpaused.is_set():
                    self._busy += 1
                    return

    def _batch(
        self, requests: Sequence[GroupRequest], *, version: int
    ) -> tuple[list[list[int]], list[SglangSampling]]:
        """sglang's ``input_ids`` and ``sampling_params``: one entry per sample, each
        seeded by (run seed, prompt index, sample index, weight version)."""
        input_ids: list[list[int]] = []
        sampling: list[SglangSampling] = []
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
        return input_ids, sampling

    def _group_outputs(
        self, requests: Sequence[GroupRequest], raw: Sequence[SglangOutput], *, version: int
    ) -> list[GroupOutput]:
        """sglang's flat results (``params.n`` per request, in order) as one
        :class:`GroupOutput` per request."""
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
        """Release all of sglang's GPU memory (see the class docstring for the weights)."""
        with self._gate.exclusive():
            if self._released:
                _log.info("engine %s: already released", self.engine_id)
                return
            if not self._memory_saver:  # sglang would only log a warning and keep it all
                raise RuntimeError(
                    f"engine {self.engine_id}: cannot release its GPU memory: it was started "
                    "with enable_memory_saver=False (rollout.engine_kwargs), so sglang keeps "
                    "its weights, KV cache and CUDA graphs; remove that key (colocated "
                    "engines need the memory saver)"
                )
            self._call(self._wait_idle, "releasing its memory")
            self._call(self.engine.release_memory_occupation)
            self._released = self._weights_released = True

    def resume_memory(self) -> None:
        """Bring back what ``release_memory`` released and a refit has not (the weights
        come back with the first refit while released)."""
        with self._gate.exclusive():
            if not self._released:
                _log.info("engine %s: already resident", self.engine_id)
                return
            if self._weights_released:
                self._call(self.engine.resume_memory_occupation)
                self._weights_resumed()
            else:  # a refit brought the weights back: the rest only
                rest = [t for t in self._memory_tags() if t != _WEIGHTS]
                self._call(self.engine.resume_memory_occupation, tags=rest)
            self._released = False

    def _wait_idle(self, what: str) -> None:
        """On the sglang thread: return once sglang's scheduler is fully idle. sglang
        0.5.23 asserts it in ``release_memory_occupation`` (a failed assertion ends its
        scheduler, and with it the engine) and, after a weight update, reports the
        update failed when it could not flush its cache; the last request's output can
        reach this process while the scheduler still holds its batch (overlap
        scheduling). ``flush_cache`` succeeds only when idle (the cache it drops is
        dropped by the release or the update anyway), so it is retried for up to
        :data:`IDLE_WAIT_S`. An sglang without it is not waited for."""
        flush = getattr(self.engine, "flush_cache", None)
        if flush is None:
            return
        deadline = time.monotonic() + IDLE_WAIT_S
        while getattr(flush(), "success", True) is False:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine {self.engine_id}: sglang's scheduler was not idle within "
                    f"{IDLE_WAIT_S:.0f} s before {what} (its flush_cache kept failing: "
                    "requests still queued or running; see the sglang log)"
                )
            time.sleep(0.005)

    def _memory_tags(self) -> list[str]:
        try:
            from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
        except ImportError:  # an sglang without them (or a stand-in): 0.5.23's
            return ["kv_cache", _WEIGHTS, "cuda_graph"]
        return list(GPU_MEMORY_ALL_TYPES)

    def _resume_weights(self) -> None:
        """Before a weight update while released: map the weights' memory again (an
        update into released memory writes to unmapped addresses). Holds the gate exclusively."""
        if self._weights_released:
            self._call(self.engine.resume_memory_occupation, tags=[_WEIGHTS])
            self._weights_resumed()

    def _weights_resumed(self) -> None:
        self._weights_released = False
        if not self._weights_backup:
            self._broken_weights = (
                "its weights were released without enable_weights_cpu_backup and no "
                "weight update has refilled them since; refit the engine (the driver "
                "does before each resume after a policy update) or set "
                "rollout.engine_kwargs.enable_weights_cpu_backup=true"
            )

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

    def _call(self, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """``fn(*args, **kwargs)`` on the engine's own thread (see the module docstring)."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def _apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> int:
        """Hand ``tensors`` to sglang (``update_weights_from_tensor``, CUDA IPC to its
        scheduler) in loads of at most ``load_bucket_bytes``, inside one weight-update
        session: each load's host tensors are moved to this process's GPU just before
        it, so the GPU holds one load beside the model sglang serves (a whole policy
        there at once would not fit beside sglang's static memory). sglang's cache is
        flushed once, after the last load; the first refused load ends the update."""
        self._check_layout(version, {n: t.shape for n, t in tensors.items()})
        names = list(tensors)
        sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
        loads = [[names[i] for i in b] for b in plan_buckets(sizes, bucket_bytes=self._load_bytes)]

        def load() -> None:  # each load's result checked here (the first refusal stops)
            for i, load_names in enumerate(loads):
                named = [(n, _on_gpu(tensors[n])) for n in load_names]
                result = self.engine.update_weights_from_tensor(
                    named_tensors=named, flush_cache=i == len(loads) - 1
                )
                del named  # this load's GPU copies: sglang has its own now
                _check_sglang_result(
                    result, call="update_weights_from_tensor", engine_id=self.engine_id,
                    version=version,
                )  # fmt: skip
            if torch.cuda.is_available():  # the copies' blocks, cached in this process
                torch.cuda.empty_cache()

        return self._update_weights(version, "update_weights_from_tensor", load)

    def _check_layout(self, version: int, shapes: Mapping[str, Sequence[int]]) -> None:
        """Refuse a refit that does not fit the checkpoint sglang loaded, before sglang
        sees it: sglang 0.5.23 skips a name its model lacks with a log warning and still
        reports success (those weights, and any the refit lacks, stay the old ones under
        the new version), and a wrong shape fails an assertion in its scheduler process,
        which ends the engine. Not checked where the model directory holds no
        safetensors."""
        problem = self._layout.mismatch(shapes) if self._layout is not None else None
        if problem is not None:
            raise SglangWeightUpdateError(
                f"engine {self.engine_id}: the weights for version {version} do not fit the "
                f"checkpoint sglang loaded ({self._model_path}): {problem}. Nothing was "
                "loaded; the engine keeps its weights. The trainer must send the "
                "checkpoint's Hugging Face names and shapes: the policy and the engines "
                "must be the same model (policy.model_path)"
            )

    def _update_weights(
        self, version: int, call: str, update: Callable[[], object], *, session: bool = True
    ) -> int:
        """Run ``update`` (an sglang weight update) on the sglang thread, inside a
        weight-update session when ``session`` (``begin_weight_update`` ...
        ``end_weight_update``, closed also when the update fails or raises; an sglang
        before 0.5.23 has no sessions and is called without one), and set
        ``version`` only if sglang reports success."""

        def run() -> None:
            if not self._released:  # (released: idle since the release, nothing runs)
                self._wait_idle(f"loading weight version {version}")
            begin = getattr(self.engine, "begin_weight_update", None) if session else None
            if begin is not None:
                _check_sglang_result(
                    begin(), call="begin_weight_update", engine_id=self.engine_id, version=version
                )
            try:
                result = update()
            except BaseException:
                if begin is not None:
                    try:
                        self.engine.end_weight_update()
                    except Exception:  # the update's own error is the one to report
                        _log.exception("engine %s: end_weight_update failed", self.engine_id)
                raise
            ended = self.engine.end_weight_update() if begin is not None else None
            _check_sglang_result(result, call=call, engine_id=self.engine_id, version=version)
            _check_sglang_result(  # None (no session) passes
                ended, call="end_weight_update", engine_id=self.engine_id, version=version
            )

        with self._gate.exclusive():
            self._resume_weights()
            try:
                self._call(run)
            except BaseException as exc:
                self._broken_weights = f"the update to weight version {version} failed ({exc})"
                raise
            self.weight_version = int(version)
            self._needs_weights = False
            self._broken_weights = None
        return self.weight_version

    def confirm_weights(self, *, version: int) -> int:
        with self._gate.exclusive():
            check_vouched_version(self.engine_id, holds=self.weight_version, version=version)
            self._needs_weights = False
        return self.weight_version

    def close_refit_group(self, *, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is not None:
            group.close()

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
        self.close_refit_group(group_name=group_name)  # the same name joined again
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
        # to the host bucket by bucket (an NCCL group receives on this engine's GPU):
        # _apply moves them back one load at a time
        version, tensors = receive_state_dict(group=self._groups[group_name], device="cpu")
        return self._apply(version, tensors)

    def update_weights_from_disk(self, path: str, *, version: int) -> int:
        disk_version, tensors = load_weights_from_disk(path)
        if disk_version != version:
            raise ValueError(
                f"engine {self.engine_id}: {path} holds version {disk_version}, not {version}"
            )
        return self._apply(version, tensors)

    # sglang-native transports, for drivers that speak sglang's own protocol
    def init_weights_update_group(self, **kwargs: object) -> object:
        return self._call(self.engine.init_weights_update_group, **kwargs)

    def update_weights_from_distributed(self, *, version: int, **kwargs: object) -> int:
        """sglang's ``update_weights_from_distributed`` (``kwargs``: its ``names``,
        ``dtypes``, ``shapes``, ``group_name``, ...), in a weight-update session."""
        names, shapes = kwargs.get("names"), kwargs.get("shapes")
        if isinstance(names, Sequence) and isinstance(shapes, Sequence):
            self._check_layout(version, dict(zip(names, shapes, strict=True)))
        return self._update_weights(
            version,
            "update_weights_from_distributed",
            lambda: self.engine.update_weights_from_distributed(**kwargs),
        )

    def update_weights_from_hf_dir(self, model_path: str, *, version: int) -> int:
        """sglang's ``update_weights_from_disk`` (a full HF model directory; sglang runs
        it without a weight-update session)."""
        return self._update_weights(
            version,
            "update_weights_from_disk",
            lambda: self.engine.update_weights_from_disk(model_path),
            session=False,
        )

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
    model: ModelSpec | str,
    run_seed: int,
    scheduling_strategies: Sequence[SchedulingStrategyT] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 1,
    max_restarts: int = -1,
    max_concurrency: int = 64,
    name_prefix: str = "sglang",
    engine_kwargs: Mapping[str, object] | None = None,
    released: bool = False,
) -> list[ActorRef]:
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
    handles: list[ActorRef] = []
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
            started_actor(
                cls.options(**opts).remote(
                    **source,
                    run_seed=run_seed,
                    engine_id=f"{name_prefix}-{i}",
                    released=released,
                    **dict(engine_kwargs or {}),
                )
            )
        )
    return handles
