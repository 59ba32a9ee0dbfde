"""The sglang engine: output parsing, the engine over a stand-in for ``sglang.Engine``
(arguments, one sglang thread, the refit protocol into sglang's weight-update API, the
tiny model written for it) and ``validate``'s ``rollout.engine`` checks run everywhere;
the real engine, the NCCL refit and the CLI run with ``rollout.engine=sglang`` need CUDA
and the ``sglang`` extra (``gpu`` marker, skipped here)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from ppo_driver.rollout import parse_sglang_output

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="needs the sglang extra"
)


def test_parse_sglang_output_stop_and_length() -> None:
    stop = {
        "output_ids": [5, 6, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [(-0.5, 5, None), (-0.25, 6, None), (-0.125, 2, None)],
        },
    }
    s = parse_sglang_output(stop)
    assert s.token_ids == (5, 6, 2) and s.logprobs == (-0.5, -0.25, -0.125)
    assert s.finish_reason == "stop"
    length = {
        "output_ids": [7],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "output_token_logprobs": [(-1.0, 7, None)],
        },
    }
    assert parse_sglang_output(length).finish_reason == "length"
    # a stop token that sglang left out of the output is appended
    cut = {
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [(-0.5, 5, None)],
        }
    }
    assert parse_sglang_output(cut).token_ids == (5, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_sglang
def test_sglang_engine_generates_refits_and_sleeps(tmp_path: Path) -> None:
    """Generation reflects the weights sglang really holds: greedy logprobs survive a
    release + resume with no refit (critic warm-up), change after a refit while
    released (the colocated policy step) to what a torch forward of the new weights
    gives, and come back after a refit to the first weights."""
    from ppo_driver.rollout import CharTokenizer, GroupRequest, SamplingParams, SglangEngine
    from ppo_trainer import ModelSpec, build_causal_lm, save_hf_checkpoint

    tok = CharTokenizer()
    spec = ModelSpec(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2)
    model = build_causal_lm(spec)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_hf_checkpoint(weights=weights, spec=spec, path=tmp_path / "m")
    engine = SglangEngine(
        model_path=str(tmp_path / "m"),
        run_seed=0,
        skip_tokenizer_init=True,
        mem_fraction_static=0.2,
    )
    prompt = tuple(tok.encode("a3:"))
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0, stop_token_ids=(tok.eos_id,))
    req = GroupRequest(prompt_index=0, prompt_ids=prompt, params=greedy)

    def run() -> tuple[int, tuple[int, ...], torch.Tensor]:
        (out,) = engine.generate([req])
        (sample,) = out.samples
        assert len(sample.token_ids) == len(sample.logprobs) >= 1
        return out.weight_version, sample.token_ids, torch.tensor(sample.logprobs)

    def colocated_step(refit: dict[str, torch.Tensor] | None, version: int) -> None:
        engine.pause_generation()
        engine.release_memory()
        if refit is not None:
            assert engine._apply(version, {k: v.cuda() for k, v in refit.items()}) == version
        engine.resume_memory()
        engine.continue_generation()

    try:
        sampled = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=(tok.eos_id,))
        (out,) = engine.generate([GroupRequest(prompt_index=1, prompt_ids=prompt, params=sampled)])
        assert len(out.samples) == 2 and out.weight_version == 0
        v0, t0, l0 = run()
        assert v0 == 0
        colocated_step(None, 0)  # weights kept by the CPU backup
        _, t, lp = run()
        assert t == t0 and torch.allclose(lp, l0, atol=1e-3), (lp, l0)
        # far from the first weights: a sharp output layer
        other = {k: v * 40 if k.startswith("lm_head") else v for k, v in weights.items()}
        colocated_step(other, 1)
        v1, t1, l1 = run()
        assert v1 == 1
        model.load_state_dict(other)
        with torch.no_grad():
            ids = torch.tensor([list(prompt) + list(t1)])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(t1)[:, None])[:, 0]
        n = min(len(t1), len(l1))
        assert torch.allclose(l1[:n], ref[:n], atol=0.05), (l1, ref)  # sglang holds `other`
        assert t1 != t0 or not torch.allclose(l1, l0, atol=0.05)
        assert engine._apply(2, {k: v.cuda() for k, v in weights.items()}) == 2
        v2, t2, l2 = run()
        assert v2 == 2 and t2 == t0 and torch.allclose(l2, l0, atol=1e-3), (l2, l0)
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: NCCL refuses two ranks on one GPU (the driver refits "
    "over gloo when trainer and engine share one)",
)
def test_nccl_refit_into_embedded_engine_on_gpu() -> None:
    import ray
    from ppo_driver.rollout import WeightRefitter, launch_embedded_engines, tiny_qwen2_config
    from ppo_placement import shutdown_local_ray, start_local_ray

    start_local_ray(num_gpus=2, num_cpus=4)
    try:

        @ray.remote(num_gpus=1)
        class Holder:
            def __init__(self) -> None:
                from ppo_driver.rollout import build_model

                self.model = build_model(tiny_qwen2_config(), seed=1, device="cuda")

            def export_weights(self) -> dict[str, torch.Tensor]:
                return {k: v.detach() for k, v in self.model.state_dict().items()}

        holder = Holder.remote()  # type: ignore[attr-defined]
        (engine,) = launch_embedded_engines(
            1, model=tiny_qwen2_config(), run_seed=0, num_gpus=1, device="cuda"
        )
        stats = WeightRefitter(actor=holder, engines=[engine], backend="nccl").refit(version=1)
        assert stats.transport == "nccl" and ray.get(engine.health.remote()).weight_version == 1
    finally:
        shutdown_local_ray()


# -- the engine over a stand-in for sglang.Engine (CPU): threads, arguments, refit ----------


_ALL_TAGS = ("kv_cache", "weights", "cuda_graph")


class _FakeSglEngine:
    """Records what ``SglangEngine`` asks of ``sglang.Engine`` and on which thread, and
    behaves like sglang 0.5.23's ``Engine`` where the driver depends on it:

    - ``update_weights_from_tensor`` / ``_from_distributed`` load only between
      ``begin_weight_update()`` and ``end_weight_update()``, and report a refusal as
      ``(False, message)`` (no exception); ``update_weights_from_disk`` needs no session
      and returns ``(success, message, num_paused_requests)``;
    - ``release_memory_occupation(tags=None)`` releases all three tags; releasing the
      weights without ``enable_weights_cpu_backup`` loses their contents; resuming a tag
      that is not released raises (sglang's ``offload_tags.remove``); a weight update
      into released weights memory is an illegal memory access (raised here);
    - generating from lost weights gives sglang's NaN-guard finish;
    - like sglang's ``Engine``, it makes an event loop for the thread that builds it
      (``loop``), ``async_generate`` runs on it and ``generate`` drives it.

    ``weights``: the tensors the model holds (None: lost); ``fail_update``: a message
    the next tensor update fails with; ``running`` / ``peak_running``: requests in
    ``async_generate`` now / at most; ``hold_until_running``: a request waits (up to 30
    s, then fails) until that many are in flight together."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, int]] = [("__init__", threading.get_ident())]
        self.updates: list[dict[str, torch.Tensor]] = []
        self.flushes: list[bool] = []  # flush_cache of each tensor update
        self.busy_polls = 0  # flush_cache fails this many more times (not idle yet)
        self.weights: dict[str, torch.Tensor] | None = {}
        self.offloaded: set[str] = set()
        self.session = False
        self.fail_update: str | None = None
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.running = self.peak_running = 0
        self.hold_until_running = 0
        self.delay_s = 0.01

    def _mark(self, name: str) -> None:
        self.calls.append((name, threading.get_ident()))

    def flush_cache(self) -> SimpleNamespace:
        """0.5.23: succeeds only when the scheduler is fully idle."""
        self._mark("flush_cache")
        if self.busy_polls > 0:
            self.busy_polls -= 1
            return SimpleNamespace(success=False, message="")
        return SimpleNamespace(success=True, message="")

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        self._mark("begin_weight_update")
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        self._mark("end_weight_update")
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def _load(self, name: str, tensors: dict[str, torch.Tensor]) -> tuple[bool, str]:
        if not self.session:
            return False, f"{name} must run between begin_weight_update() and end_weight_update()"
        if "weights" in self.offloaded:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.fail_update is not None:
            message, self.fail_update = self.fail_update, None
            return False, message
        self.weights = {**(self.weights or {}), **tensors}
        return True, "Success"

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        self._mark("update_weights_from_tensor")
        self.updates.append(dict(named_tensors))
        self.flushes.append(flush_cache)
        return self._load("update_weights_from_tensor", dict(named_tensors))

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> tuple[bool, str]:
        self._mark("update_weights_from_distributed")
        tensors = {n: torch.zeros(shape) for n, shape in zip(names, shapes, strict=True)}
        return self._load("update_weights_from_distributed", tensors)

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None
    ) -> tuple[bool, str, int]:
        self._mark("update_weights_from_disk")
        if model_path.startswith("/missing"):
            return False, f"Failed to get weights iterator: {model_path}", 0
        self.weights = {"from_disk": torch.zeros(1)}
        return True, "Succeeded to update model weights.", 0

    def generate(self, **kwargs: Any) -> list[dict[str, Any]]:
        self._mark("generate")
        out: list[dict[str, Any]] = self.loop.run_until_complete(self.async_generate(**kwargs))
        return out

    async def async_generate(
        self,
        *,
        input_ids: list[list[int]],
        sampling_params: list[dict[str, Any]],
        return_logprob: bool,
    ) -> list[dict[str, Any]]:
        self._mark("async_generate")
        assert return_logprob and len(input_ids) == len(sampling_params)
        assert not self.offloaded, f"generate with {sorted(self.offloaded)} released"
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            deadline = time.monotonic() + 30
            while self.running < self.hold_until_running:
                assert time.monotonic() < deadline, f"{self.running} request(s) in flight"
                await asyncio.sleep(0.005)
            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1
            self._mark("async_generate done")
        return self._outputs(input_ids)

    def _outputs(self, input_ids: list[list[int]]) -> list[dict[str, Any]]:
        if self.weights is None:  # garbage weights: NaN logits
            return [
                {
                    "output_ids": [2],
                    "meta_info": {
                        "finish_reason": {"type": "stop", "matched": "NaN happened"},
                        "output_token_logprobs": [(float("nan"), 99, None)],
                    },
                }
                for _ in input_ids
            ]
        return [
            {
                "output_ids": [7, 2],
                "meta_info": {
                    "finish_reason": {"type": "stop", "matched": 2},
                    "output_token_logprobs": [(-0.5, 7, None), (-0.25, 2, None)],
                },
            }
            for _ in input_ids
        ]

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._mark("release")
        if not self.kwargs.get("enable_memory_saver"):
            return  # 0.5.23 without the memory saver: a stand-in that only logs a warning
        for tag in tags or _ALL_TAGS:
            assert tag not in self.offloaded, f"{tag} released twice"
            self.offloaded.add(tag)
            if tag == "weights" and not self.kwargs.get("enable_weights_cpu_backup"):
                self.weights = None  # torch_memory_saver drops the contents

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._mark("resume")
        for tag in tags or _ALL_TAGS:
            self.offloaded.remove(tag)  # KeyError, as sglang's offload_tags.remove

    def shutdown(self) -> None:
        self._mark("shutdown")
        self.loop.close()


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_driver.rollout import _sglang

    monkeypatch.setattr(_sglang, "_import_sglang", lambda: SimpleNamespace(Engine=_FakeSglEngine))


def _request(prompt_index: int, n: int = 2) -> Any:
    from ppo_driver.rollout import GroupRequest, SamplingParams

    params = SamplingParams(n=n, max_new_tokens=4, stop_token_ids=(2,), temperature=0.7)
    return GroupRequest(prompt_index=prompt_index, prompt_ids=(4, 5, 6), params=params)


def test_engine_arguments_and_one_sglang_thread(fake_sglang: None) -> None:
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/models/m", run_seed=3, mem_fraction_static=0.3)
    fake = engine.engine
    assert fake.kwargs == {
        "model_path": "/models/m",
        "random_seed": 3,
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,  # release keeps the weights' contents
        "log_level": "error",
        "mem_fraction_static": 0.3,
    }
    with ThreadPoolExecutor(4) as pool:  # Ray runs a threaded actor's calls like this
        outs = list(pool.map(lambda i: engine.generate([_request(i)]), range(6)))
    engine.release_memory()
    engine.resume_memory()
    engine.shutdown()
    engine.shutdown()  # idempotent
    threads = {t for _, t in fake.calls}
    assert len(threads) == 1 and threading.get_ident() not in threads  # sglang's own thread
    assert [name for name, _ in fake.calls].count("shutdown") == 1
    for i, (out,) in enumerate(outs):
        assert out.prompt_index == i and out.weight_version == 0
        assert [s.token_ids for s in out.samples] == [(7, 2), (7, 2)]
        assert out.samples[0].finish_reason == "stop"


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_concurrent_calls_are_in_sglang_together(fake_sglang: None) -> None:
    """One group per call (the driver's default with sglang) must not mean one group at
    a time: concurrent calls are in sglang together, for its continuous batching. The
    stand-in holds every request until 4 are in flight at once (fails after 30 s)."""
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/m", run_seed=0)
    fake = engine.engine
    fake.hold_until_running = 4
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: engine.generate([_request(i)]), range(4)))
    assert fake.peak_running == 4
    assert [out.prompt_index for (out,) in outs] == [0, 1, 2, 3]
    assert engine.health().groups_served == 4
    assert len({t for _, t in fake.calls}) == 1  # still sglang's own thread only
    fake.hold_until_running = 0
    (out,) = engine.generate([_request(9)])  # the loop serves again after going idle
    assert out.prompt_index == 9
    engine.shutdown()


def test_an_sglang_without_engine_loop_runs_on_its_threads_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An sglang ``Engine`` with no ``loop`` attribute (before 0.5) drives the calling
    thread's current loop: the engine takes that one (made if the thread has none)."""
    from ppo_driver.rollout import SglangEngine, _sglang

    class NoLoopAttribute(_FakeSglEngine):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.thread_loop = self.loop
            del self.loop
            asyncio.set_event_loop(None)  # and the thread has no current loop either

        def shutdown(self) -> None:
            self.thread_loop.close()

    monkeypatch.setattr(_sglang, "_import_sglang", lambda: SimpleNamespace(Engine=NoLoopAttribute))
    engine = SglangEngine(model_path="/m", run_seed=0)
    (out,) = engine.generate([_request(3)])
    assert out.prompt_index == 3 and [s.token_ids for s in out.samples] == [(7, 2), (7, 2)]
    loop = engine._loop
    engine.shutdown()
    loop.close()


def test_a_weight_update_waits_for_the_calls_in_flight_and_holds_new_ones(
    fake_sglang: None,
) -> None:
    """Every output carries the version that produced all its samples: an update waits
    until the requests in flight are done, and a call that comes while it waits
    generates after it, with the new weights."""
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/m", run_seed=0)
    fake = engine.engine
    fake.delay_s = 0.3
    with ThreadPoolExecutor(5) as pool:
        first = [pool.submit(engine.generate, [_request(i)]) for i in range(3)]
        _wait_for(lambda: fake.running == 3, "3 requests in sglang")
        update = pool.submit(engine.update_weights_from_hf_dir, "/new", version=1)
        _wait_for(lambda: engine._gate._waiting == 1, "the update to wait")
        late = pool.submit(engine.generate, [_request(7)])
        assert update.result(timeout=60) == 1
        assert [f.result(timeout=60)[0].weight_version for f in first] == [0, 0, 0]
        assert late.result(timeout=60)[0].weight_version == 1
    names = [name for name, _ in fake.calls]
    at = names.index("update_weights_from_disk")
    assert names[:at].count("async_generate done") == 3
    assert names[at:].count("async_generate") == 1  # the late call, after the update
    engine.shutdown()


def test_per_sample_seeds_and_stop_tokens_reach_sglang(fake_sglang: None) -> None:
    from ppo_driver.rollout import SglangEngine, sample_seed

    engine = SglangEngine(model_path="/m", run_seed=5)
    seen: list[dict[str, Any]] = []
    original = engine.engine.async_generate

    def spy(**kwargs: Any) -> Any:
        seen.extend(kwargs["sampling_params"])
        return original(**kwargs)

    engine.engine.async_generate = spy
    engine.generate([_request(11, n=3)])
    assert [p["sampling_seed"] for p in seen] == [
        sample_seed(run_seed=5, prompt_index=11, sample_index=j, weight_version=0) % 2**31
        for j in range(3)
    ]
    assert all(p["stop_token_ids"] == [2] and p["temperature"] == 0.7 for p in seen)
    engine.shutdown()


def test_refit_protocol_hands_the_weights_to_sglang(fake_sglang: None) -> None:
    """The driver's refit (rank 0 broadcasts over a private gloo group) -> the engine
    receives -> sglang's weight-update API (``update_weights_from_tensor``)."""
    from ppo_driver.rollout import SglangEngine, broadcast_state_dict, connect_group, open_store

    engine = SglangEngine(model_path="/m", run_seed=0)
    weights = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.float32)}
    store, port = open_store(host="127.0.0.1", world_size=2, timeout_s=60)
    with ThreadPoolExecutor(2) as pool:
        sender = pool.submit(
            connect_group,
            store=store,
            master_addr="127.0.0.1",
            master_port=0,
            rank=0,
            world_size=2,
            backend="gloo",
        )
        engine.init_refit_group(
            master_addr="127.0.0.1",
            master_port=port,
            rank=1,
            world_size=2,
            backend="gloo",
            group_name="g",
        )
        group = sender.result(timeout=60)
        receive = pool.submit(engine.receive_weights, group_name="g")
        broadcast_state_dict(weights, group=group, version=4, bucket_bytes=16)
        assert receive.result(timeout=60) == 4
    assert engine.health().weight_version == 4
    (update,) = engine.engine.updates
    assert set(update) == set(weights) and _holds(engine.engine, weights)  # loaded, too
    for name, tensor in weights.items():
        assert torch.equal(update[name], tensor)
    engine.close_refit_group(group_name="g")
    engine.shutdown()


def test_a_refit_reaches_sglang_in_bounded_loads_in_one_session(fake_sglang: None) -> None:
    """A refit is handed over in loads of at most ``load_bucket_bytes`` (a larger tensor
    alone), in the refit's order, inside one weight-update session, the cache flushed
    after the last load only: the GPU holds one load beside the served model, not the
    whole policy. A refused load ends the update: the session is closed, the later loads
    are not sent, and the engine generates nothing until an update succeeds."""
    from ppo_driver.rollout import SglangEngine, SglangWeightUpdateError

    weights = {  # 16, 16, 40 (alone: over the bound), 8 and 8 bytes
        "a": torch.zeros(4), "b": torch.ones(4), "big": torch.full((10,), 2.0),
        "c": torch.full((2,), 3.0), "d": torch.full((2,), 4.0),
    }  # fmt: skip
    engine = SglangEngine(model_path="/m", run_seed=0, load_bucket_bytes=32)
    fake = engine.engine
    assert engine._apply(1, weights) == 1
    assert [list(u) for u in fake.updates] == [["a", "b"], ["big"], ["c", "d"]]
    assert fake.flushes == [False, False, True]
    calls = [name for name, _ in fake.calls if "weight" in name]
    assert calls == [
        "begin_weight_update",
        *["update_weights_from_tensor"] * 3,
        "end_weight_update",
    ]
    assert _holds(fake, weights) and not fake.session

    real_update = fake.update_weights_from_tensor

    def refuse_the_second(named_tensors: Any, **kwargs: Any) -> tuple[bool, str]:
        if len(fake.updates) == 4:  # the second load of this update
            fake.fail_update = "Unknown parameter name: big"
        return real_update(named_tensors, **kwargs)

    fake.update_weights_from_tensor = refuse_the_second
    with pytest.raises(SglangWeightUpdateError, match="Unknown parameter name: big"):
        engine._apply(2, weights)
    assert len(fake.updates) == 5 and not fake.session  # stopped there, session closed
    assert engine.weight_version == 1
    with pytest.raises(RuntimeError, match="failed"):
        engine.generate([_request(0)])
    with pytest.raises(ValueError, match="load_bucket_bytes=0"):
        SglangEngine(model_path="/m", run_seed=0, load_bucket_bytes=0)
    engine.shutdown()


def test_release_and_update_wait_until_sglang_is_idle(
    fake_sglang: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sglang 0.5.23 asserts an idle scheduler in release_memory_occupation (a failure
    ends the engine) and fails an update whose cache flush found it busy; the last
    output can arrive before the scheduler drops its batch. Both wait (flush_cache
    succeeds only when idle), and give up with an error, touching nothing, after
    IDLE_WAIT_S."""
    from ppo_driver.rollout import SglangEngine, _sglang

    engine = SglangEngine(model_path="/m", run_seed=0)
    fake = engine.engine

    def calls_of(action: Callable[[], object]) -> list[str]:
        before = len(fake.calls)
        action()
        return [name for name, _ in fake.calls[before:]]

    fake.busy_polls = 3
    assert calls_of(lambda: engine._apply(1, _weights(1.0))) == [
        *["flush_cache"] * 4, "begin_weight_update", "update_weights_from_tensor",
        "end_weight_update",
    ]  # fmt: skip
    fake.busy_polls = 2
    assert calls_of(engine.release_memory) == [*["flush_cache"] * 3, "release"]
    # released: idle since the release (nothing generates), so no wait
    assert "flush_cache" not in calls_of(lambda: engine._apply(2, _weights(2.0)))
    engine.resume_memory()

    monkeypatch.setattr(_sglang, "IDLE_WAIT_S", 0.05)
    fake.busy_polls = 10**6
    with pytest.raises(RuntimeError, match="not idle within 0 s before releasing its memory"):
        engine.release_memory()
    assert not fake.offloaded and not engine.health().memory_released
    with pytest.raises(RuntimeError, match=r"not idle .* before loading weight version 3"):
        engine._apply(3, _weights(3.0))
    assert engine.weight_version == 2 and not fake.session
    engine.shutdown()


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((2, 2), value), "b.bias": torch.full((3,), value)}


def _holds(fake: Any, weights: dict[str, torch.Tensor]) -> bool:
    return fake.weights is not None and all(
        torch.equal(fake.weights[k], v) for k, v in weights.items()
    )


def test_refit_loads_inside_a_weight_update_session(fake_sglang: None) -> None:
    """sglang 0.5.23 loads nothing outside begin/end_weight_update and says so only in
    its result: the engine opens the session, and the weights really arrive."""
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/m", run_seed=0)
    fake = engine.engine
    assert engine._apply(1, _weights(1.0)) == 1
    assert _holds(fake, _weights(1.0)) and not fake.session
    names = [name for name, _ in fake.calls]
    assert names[-3:] == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert (
        engine.update_weights_from_distributed(
            version=2, names=["c"], dtypes=["float32"], shapes=[[2]], group_name="g"
        )
        == 2
    )
    assert torch.equal(fake.weights["c"], torch.zeros(2)) and not fake.session
    assert engine.update_weights_from_hf_dir("/models/new", version=3) == 3
    assert engine.health().weight_version == 3
    assert len({t for _, t in fake.calls}) == 1  # all on sglang's thread
    engine.shutdown()


def test_a_refused_weight_update_raises_and_keeps_the_version(fake_sglang: None) -> None:
    from ppo_driver.rollout import SglangEngine, SglangWeightUpdateError

    engine = SglangEngine(model_path="/m", run_seed=0)
    fake = engine.engine
    fake.fail_update = "Unknown parameter name: x.weight"
    with pytest.raises(SglangWeightUpdateError, match=r"update_weights_from_tensor.*x\.weight"):
        engine._apply(1, _weights(1.0))
    assert engine.health().weight_version == 0
    assert not fake.session  # the session was closed on the failure too
    with pytest.raises(RuntimeError, match=r"refused.*version 1 failed"):
        engine.generate([_request(0)])  # possibly half-loaded weights: no samples
    with pytest.raises(SglangWeightUpdateError, match=r"update_weights_from_disk.*missing"):
        engine.update_weights_from_hf_dir("/missing/model", version=1)
    assert engine.health().weight_version == 0
    assert engine._apply(1, _weights(1.0)) == 1  # a later update succeeds: it generates
    (out,) = engine.generate([_request(0)])
    assert out.weight_version == 1
    engine.shutdown()


def test_colocated_release_refit_resume_keeps_the_latest_weights(fake_sglang: None) -> None:
    """The colocated step: pause + release, train, (refit), resume. After every resume
    sglang holds the latest weights: with no refit (critic warm-up) thanks to the
    weights' CPU backup, and a refit while released first maps the weights' memory."""
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/m", run_seed=0)
    fake = engine.engine
    engine._apply(1, _weights(1.0))
    # a critic warm-up step: no refit
    engine.pause_generation()
    engine.release_memory()
    assert fake.offloaded == set(_ALL_TAGS) and engine.health().memory_released
    engine.resume_memory()
    engine.continue_generation()
    assert not fake.offloaded and _holds(fake, _weights(1.0))
    (out,) = engine.generate([_request(0)])
    assert out.samples[0].finish_reason == "stop"
    # a policy step: the refit comes while released
    engine.pause_generation()
    engine.release_memory()
    assert engine._apply(2, _weights(2.0)) == 2
    assert fake.offloaded == {"kv_cache", "cuda_graph"} and _holds(fake, _weights(2.0))
    assert engine.health().memory_released
    engine.resume_memory()
    engine.continue_generation()
    assert not fake.offloaded and _holds(fake, _weights(2.0))
    (out,) = engine.generate([_request(0)])
    assert out.weight_version == 2 and out.samples[0].finish_reason == "stop"
    engine.shutdown()


def test_released_without_weights_backup_generates_only_after_a_refit(
    fake_sglang: None,
) -> None:
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/m", run_seed=0, enable_weights_cpu_backup=False)
    fake = engine.engine
    engine.release_memory()
    engine.resume_memory()
    assert fake.weights is None  # sglang lost them
    with pytest.raises(RuntimeError, match="enable_weights_cpu_backup"):
        engine.generate([_request(0)])
    engine.release_memory()
    engine._apply(1, _weights(1.0))
    engine.resume_memory()
    (out,) = engine.generate([_request(0)])
    assert out.weight_version == 1 and _holds(fake, _weights(1.0))
    engine.shutdown()


def test_engine_without_memory_saver_refuses_to_release(fake_sglang: None) -> None:
    """sglang started with enable_memory_saver=False keeps its memory on a release (it
    only logs a warning): the engine says so instead of counting itself released."""
    from ppo_driver.rollout import SglangEngine

    engine = SglangEngine(model_path="/m", run_seed=0, enable_memory_saver=False)
    fake = engine.engine
    with pytest.raises(RuntimeError, match="enable_memory_saver=False"):
        engine.release_memory()
    assert "release" not in [name for name, _ in fake.calls]
    (out,) = engine.generate([_request(0)])  # still resident, still serving
    assert out.weight_version == 0
    engine.shutdown()
    with pytest.raises(ValueError, match="needs enable_memory_saver"):  # before sglang starts
        SglangEngine(model_path="/m", run_seed=0, released=True, enable_memory_saver=False)


def test_engine_serves_in_a_half_precision_trainer_dtype(fake_sglang: None) -> None:
    from ppo_driver.rollout import SglangEngine
    from ppo_trainer import ModelSpec

    def kwargs(**extra: Any) -> dict[str, Any]:
        engine = SglangEngine(run_seed=0, **extra)
        engine.shutdown()
        return dict(engine.engine.kwargs)

    assert kwargs(model=ModelSpec(path="/m", dtype="bfloat16"))["dtype"] == "bfloat16"
    assert "dtype" not in kwargs(model=ModelSpec(path="/m"))  # float32: sglang's auto
    assert kwargs(model=ModelSpec(path="/m", dtype="bfloat16"), dtype="float16")["dtype"] == (
        "float16"
    )
    assert "dtype" not in kwargs(model_path="/m")
    assert kwargs(model_path="/m", enable_memory_saver=False)["enable_weights_cpu_backup"] is False


def test_parse_sglang_output_refuses_unfinished_samples() -> None:
    from ppo_driver.rollout import SglangGenerationError

    abort = {
        "output_ids": [5],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None},
            "output_token_logprobs": [(-0.5, 5, None)],
        },
    }
    with pytest.raises(SglangGenerationError, match=r"abort.*Aborted"):
        parse_sglang_output(abort)
    nan = {
        "output_ids": [2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": "NaN happened"},
            "output_token_logprobs": [(float("nan"), 99, None)],
        },
    }
    with pytest.raises(SglangGenerationError, match="NaN"):
        parse_sglang_output(nan)
    with pytest.raises(SglangGenerationError):
        parse_sglang_output({"meta_info": {"output_token_logprobs": [(-1.0, 3, None)]}})


def test_tiny_model_is_written_for_sglang(tmp_path: Path, fake_sglang: None) -> None:
    from ppo_driver.rollout import SglangEngine, materialize_model
    from ppo_trainer import ModelSpec, build_causal_lm
    from transformers import AutoModelForCausalLM

    spec = ModelSpec(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, seed=7)  # fmt: skip
    path = materialize_model(spec, str(tmp_path / "m"))
    loaded = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).state_dict()
    expected = build_causal_lm(spec).state_dict()  # what the trainer starts from
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert materialize_model(ModelSpec(path=path)) == path  # a directory is used as it is
    engine = SglangEngine(model=spec, run_seed=0)
    assert (Path(engine.engine.kwargs["model_path"]) / "config.json").is_file()
    engine.shutdown()
    with pytest.raises(ValueError, match="exactly one of model_path and model"):
        SglangEngine(model_path=path, model=spec, run_seed=0)


def test_a_refit_that_does_not_fit_the_checkpoint_never_reaches_sglang(
    tmp_path: Path, fake_sglang: None
) -> None:
    """sglang 0.5.23 skips a name its model lacks (a log warning, then success: stale
    weights under the new version) and asserts on a wrong shape in its scheduler (the
    engine dies): the engine checks the refit against the checkpoint sglang loaded
    first, and refuses before sglang sees anything."""
    from ppo_driver.rollout import SglangEngine, SglangWeightUpdateError, materialize_model
    from ppo_driver.rollout._refit import save_weights_to_disk
    from ppo_trainer import ModelSpec, build_causal_lm

    spec = ModelSpec(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, seed=7)  # fmt: skip
    path = materialize_model(spec, str(tmp_path / "m"))
    engine = SglangEngine(model_path=path, run_seed=0)
    fake = engine.engine
    good = build_causal_lm(spec).state_dict()
    renamed = {k.replace("model.", "base.", 1): v for k, v in good.items()}
    wider = {**good, "model.norm.weight": torch.ones(33)}
    short = {k: v for k, v in good.items() if k != "lm_head.weight"}
    cases = [
        (renamed, r"unknown \d+: base\..*missing \d+: "),
        (wider, r"shape 1: model\.norm\.weight \[33\] \(the checkpoint's \[32\]\)"),
        (short, r"missing 1: lm_head\.weight"),  # the tiny model's head is not tied
    ]
    for version, (tensors, message) in enumerate(cases, start=1):
        disk = save_weights_to_disk(tensors, tmp_path / f"v{version}", version=version)
        with pytest.raises(SglangWeightUpdateError, match=message):
            engine.update_weights_from_disk(disk, version=version)
        assert fake.updates == [] and engine.weight_version == 0  # sglang saw nothing
    with pytest.raises(SglangWeightUpdateError, match="unknown 1: extra"):
        engine.update_weights_from_distributed(
            version=4, names=["extra"], dtypes=["float32"], shapes=[[1]], group_name="g"
        )
    disk = save_weights_to_disk(good, tmp_path / "v5", version=5)
    assert engine.update_weights_from_disk(disk, version=5) == 5
    assert set(fake.updates[0]) == set(good)
    engine.shutdown()


def test_checkpoint_layout_reads_headers_shards_and_the_tied_head(tmp_path: Path) -> None:
    import json

    from ppo_driver.rollout._refit import CheckpointLayout, checkpoint_layout
    from safetensors.torch import save_file

    assert checkpoint_layout(tmp_path) is None  # no safetensors: nothing to check
    assert checkpoint_layout(tmp_path / "absent") is None  # a hub id, not a directory
    save_file({"a.weight": torch.zeros(2, 3)}, str(tmp_path / "s1.safetensors"))
    save_file({"embed.weight": torch.zeros(5, 2)}, str(tmp_path / "s2.safetensors"))
    index = {"weight_map": {"a.weight": "s1.safetensors", "embed.weight": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    layout = checkpoint_layout(tmp_path)
    assert layout == CheckpointLayout({"a.weight": (2, 3), "embed.weight": (5, 2)}, tied=False)
    assert layout.mismatch({"a.weight": (2, 3), "embed.weight": (5, 2)}) is None
    assert layout.mismatch({"a.weight": (2, 3), "embed.weight": (5, 2), "lm_head.weight": (5, 2)})
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    tied = checkpoint_layout(tmp_path)
    assert tied is not None and tied.tied
    # a tied head may be sent (the trainer's state dict names it) or not
    assert (
        tied.mismatch({"a.weight": [2, 3], "embed.weight": [5, 2], "lm_head.weight": [5, 2]})
        is None
    )
    assert tied.mismatch({"a.weight": [2, 3], "embed.weight": [5, 2]}) is None
    (tmp_path / "config.json").unlink()  # no config: transformers' default, tied
    assert checkpoint_layout(tmp_path) == tied
    many = CheckpointLayout({f"w{i}": (1,) for i in range(6)})
    assert many.mismatch({}) == "missing 6: w0, w1, w2, w3, ..."


# -- validate: rollout.engine ------------------------------------------------------------


def _engine_problems(
    monkeypatch: pytest.MonkeyPatch, *overrides: str, sglang: bool, cuda: bool
) -> list[Any]:
    from ppo_driver import _machine as config_mod
    from ppo_driver.config import load_config

    real = config_mod.module_available
    monkeypatch.setattr(
        config_mod, "module_available", lambda name: sglang if name == "sglang" else real(name)
    )
    monkeypatch.setattr(config_mod, "cuda_available", lambda: cuda)
    _, report = load_config(None, list(overrides), check=False)
    return report.errors


@pytest.mark.parametrize(
    ("sglang", "cuda", "needs"),
    [
        (False, False, ("ppo-driver[sglang]", "CUDA")),
        (False, True, ("ppo-driver[sglang]",)),
        (True, False, ("CUDA",)),
    ],
)
def test_validate_says_what_sglang_is_missing(
    monkeypatch: pytest.MonkeyPatch, sglang: bool, cuda: bool, needs: tuple[str, ...]
) -> None:
    errors = _engine_problems(monkeypatch, "rollout.engine=sglang", sglang=sglang, cuda=cuda)
    assert [p.key for p in errors] == ["rollout.engine"], errors
    (error,) = errors
    assert all(word in error.message for word in needs), error.message
    assert ("extra" in error.message) == (not sglang)
    assert "rollout.engine=embedded" in error.fix


def test_validate_refuses_sglang_on_this_machine() -> None:
    if importlib.util.find_spec("sglang") is not None and torch.cuda.is_available():
        pytest.skip("sglang can run here")
    from ppo_driver.config import load_config

    _, report = load_config(None, ["rollout.engine=sglang"], check=False)
    assert [p.key for p in report.errors] == ["rollout.engine"]
    assert "cannot run on this machine" in report.errors[0].message


def test_validate_engine_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = _engine_problems(
        monkeypatch,
        "rollout.engine=sglang",
        "rollout.engine_kwargs={mem_fraction_static: 0.3}",
        sglang=True,
        cuda=True,
    )
    assert ok == []
    errors = _engine_problems(
        monkeypatch,
        "rollout.engine=sglang",
        "rollout.num_engines=2",
        "rollout.engine_kwargs={tp_size: 2, model_path: /x}",
        sglang=True,
        cuda=True,
    )
    assert sorted(p.key for p in errors) == [
        "rollout.engine_kwargs.model_path",
        "rollout.engine_kwargs.tp_size",
        "rollout.num_engines",
    ]
    errors = _engine_problems(monkeypatch, "rollout.engine=vllm", sglang=True, cuda=True)
    assert [p.key for p in errors] == ["rollout.engine"] and "embedded, sglang" in errors[0].fix
    errors = _engine_problems(
        monkeypatch, "rollout.engine_kwargs={mem_fraction_static: 0.3}", sglang=True, cuda=True
    )
    assert [p.key for p in errors] == ["rollout.engine_kwargs"]  # embedded: unused


def _fake_server_args(monkeypatch: pytest.MonkeyPatch, server_args: Any) -> None:
    """``sglang.srt.server_args.ServerArgs`` is ``server_args`` (no sglang needed)."""
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    module = ModuleType("sglang.srt.server_args")
    module.ServerArgs = server_args  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", module)


def _fake_msgspec(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in for msgspec (not installed here): ``Struct`` and ``structs.fields``,
    as sglang 0.5.23's ``ServerArgs`` (a ``msgspec.defstruct``) is read."""
    msgspec = ModuleType("msgspec")

    class Struct:
        __struct_fields__: tuple[str, ...] = ()

    def fields(cls: type) -> tuple[Any, ...]:
        if not (isinstance(cls, type) and issubclass(cls, Struct)):
            raise TypeError("not a Struct")
        return tuple(SimpleNamespace(name=n) for n in cls.__struct_fields__)

    msgspec.Struct = Struct  # type: ignore[attr-defined]
    msgspec.structs = SimpleNamespace(fields=fields)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "msgspec", msgspec)
    return Struct


def _kwargs_problems(monkeypatch: pytest.MonkeyPatch, kwargs: str) -> list[Any]:
    from ppo_driver import _machine as config_mod

    real = config_mod.module_available
    monkeypatch.setattr(
        config_mod,
        "module_available",
        lambda name: True if name in ("sglang", "msgspec") else real(name),
    )
    return _engine_problems(
        monkeypatch,
        "rollout.engine=sglang",
        f"rollout.engine_kwargs={kwargs}",
        sglang=True,
        cuda=True,
    )


def test_validate_reads_msgspec_server_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang 0.5.23's ServerArgs is a msgspec Struct, not a dataclass."""
    struct = _fake_msgspec(monkeypatch)
    server_args = type(
        "ServerArgs", (struct,), {"__struct_fields__": ("model_path", "mem_fraction_static")}
    )
    _fake_server_args(monkeypatch, server_args)
    assert _kwargs_problems(monkeypatch, "{mem_fraction_static: 0.3}") == []
    (error,) = _kwargs_problems(monkeypatch, "{mem_fraction_statc: 0.3}")
    assert error.key == "rollout.engine_kwargs.mem_fraction_statc"
    assert "did you mean mem_fraction_static" in error.message


def test_validate_reads_dataclass_server_args(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    server_args = dataclasses.make_dataclass("ServerArgs", [("mem_fraction_static", float)])
    _fake_server_args(monkeypatch, server_args)
    assert _kwargs_problems(monkeypatch, "{mem_fraction_static: 0.3}") == []
    assert [p.key for p in _kwargs_problems(monkeypatch, "{bogus: 1}")] == [
        "rollout.engine_kwargs.bogus"
    ]


def test_validate_never_raises_on_unknown_server_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ServerArgs of another kind: the keys go unchecked (sglang checks them)."""
    _fake_msgspec(monkeypatch)
    _fake_server_args(monkeypatch, type("ServerArgs", (), {}))
    assert _kwargs_problems(monkeypatch, "{bogus: 1}") == []


def test_validate_refuses_lost_weights_in_critic_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ("rollout.engine=sglang", "cluster.colocate=true", "ppo.critic_warmup_steps=1")
    errors = _engine_problems(
        monkeypatch,
        *base,
        "rollout.engine_kwargs={enable_weights_cpu_backup: false, mem_fraction_static: 0.3}",
        sglang=False,  # sglang's ServerArgs not read: only the driver's own check
        cuda=True,
    )
    keys = [p.key for p in errors]
    assert "rollout.engine_kwargs.enable_weights_cpu_backup" in keys, errors
    error = errors[keys.index("rollout.engine_kwargs.enable_weights_cpu_backup")]
    assert "critic_warmup_steps=1" in error.message and "critic_warmup_steps=0" in error.fix
    errors = _engine_problems(
        monkeypatch, *base, "rollout.engine_kwargs={mem_fraction_static: 0.3}", sglang=True,
        cuda=True,
    )  # fmt: skip
    assert "rollout.engine_kwargs.enable_weights_cpu_backup" not in [p.key for p in errors]


def test_validate_refuses_a_colocated_engine_without_memory_saver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kwargs = "rollout.engine_kwargs={enable_memory_saver: false, mem_fraction_static: 0.3}"
    errors = _engine_problems(
        monkeypatch, "rollout.engine=sglang", "cluster.colocate=true", kwargs,
        sglang=False, cuda=True,
    )  # fmt: skip
    keys = [p.key for p in errors]
    assert "rollout.engine_kwargs.enable_memory_saver" in keys, errors
    error = errors[keys.index("rollout.engine_kwargs.enable_memory_saver")]
    assert "colocate=true" in error.message and "cluster.colocate=false" in error.fix
    errors = _engine_problems(  # generation on GPUs of its own: nothing to release
        monkeypatch, "rollout.engine=sglang", kwargs, sglang=False, cuda=True
    )
    assert "rollout.engine_kwargs.enable_memory_saver" not in [p.key for p in errors]


def test_validate_needs_the_weights_backup_only_with_a_critic_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Colocated sglang without its weights' CPU backup loses them at a release; only a
    critic warm-up step resumes generation without a refit first, so only then is it
    refused."""
    key = "rollout.engine_kwargs.enable_weights_cpu_backup"
    kwargs = "rollout.engine_kwargs={enable_weights_cpu_backup: false, mem_fraction_static: 0.3}"
    base = ("rollout.engine=sglang", "cluster.colocate=true", kwargs)
    errors = _engine_problems(monkeypatch, *base, sglang=False, cuda=True)
    assert key not in [p.key for p in errors], errors
    errors = _engine_problems(
        monkeypatch, *base, "ppo.critic_warmup_steps=1", sglang=False, cuda=True
    )
    assert key in [p.key for p in errors], errors


# -- end to end through the CLI (GPU) ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_sglang
@pytest.mark.timeout(1800)
def test_cli_trains_two_steps_with_sglang(tmp_path: Path) -> None:
    """``rollout.engine=sglang`` through the real CLI: engines on the rollout bundle
    (their own GPU, NCCL refit, streaming) or, on a one-GPU machine, colocated on the
    training GPU (full-batch, gloo refit, sglang's memory released while training).

    Colocated, a critic warm-up step (release + resume, no refit) comes first, and
    every step generates with the trainer's current weights (the refit lands before
    the resume), so the engine/trainer KL is only the float16 serving noise; a refit
    that did not reach sglang, or weights lost in the release, would show there."""
    gpus = torch.cuda.device_count()
    run_dir = tmp_path / "run"
    steps, warmup = (2, 0) if gpus >= 2 else (3, 1)
    overrides = [
        "rollout.engine=sglang",
        f"run.num_steps={steps}",
        f"ppo.critic_warmup_steps={warmup}",
        "run.checkpoint_every=0",
        "ppo.num_prompts_per_step=8",
        "ppo.num_generations_per_prompt=2",
        "ppo.critic_mini_batch_size=8",
        "rollout.max_new_tokens=8",
        *(
            f"{role}.{key}={value}"
            for role in ("policy", "critic")
            for key, value in (
                ("hidden_size", 128),
                ("intermediate_size", 256),
                ("num_hidden_layers", 2),
                ("num_attention_heads", 2),
                ("num_key_value_heads", 1),
            )
        ),
        "rollout.engine_kwargs={mem_fraction_static: 0.3, disable_cuda_graph: true}",
    ]
    if gpus >= 2:
        overrides += ["async_rl.min_groups_for_streaming_train=2"]
    else:
        overrides += ["cluster.colocate=true", "async_rl.min_groups_for_streaming_train=8"]
    cmd = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run_dir)]
    proc = subprocess.run(
        [*cmd, "--no-progress", *overrides],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == list(range(steps))
    trained = [r for r in rows if r["step"] >= warmup]
    assert all(r.get("perf/refit_bytes", 0) > 0 for r in trained)  # refits went through sglang
    assert all(r["rollout/reward_mean"] is not None for r in rows)
    if gpus < 2:  # full-batch: generated with the weights being trained (1e-3: a bound for
        # float16 serving noise, far below what stale or lost weights give)
        assert all(abs(r["rollout/kl_engine_trainer"]) < 1e-3 for r in trained), trained
