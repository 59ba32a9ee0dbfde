"""Where a sleeping worker's memory goes: the offload backend each device gets
(``offload_backend``: auto | host_copy | memory_saver) and the process groups' release
and restore hooks (NCCL communicators suspended while asleep; nothing on gloo).

The CUDA checks (``gpu``) run in a fresh process each, so NCCL state and the CUDA
context of pytest's own process do not blur them; run them on a GPU machine with
``uv run nox -s gpu``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from ppo_lifecycle import KEEP_GRADIENTS, HostCopyBackend
from ppo_trainer import (
    ActorConfig,
    ActorWorker,
    CommunicatorSuspender,
    CriticWorker,
    _offload,
    backend_importable,
    resolve_offload_backend,
)
from trainer_testlib import actor_config, critic_config

needs_megatron = pytest.mark.skipif(
    not backend_importable("megatron"), reason="needs the megatron extra"
)


# --------------------------------------------------------------------------- offload backend


@pytest.mark.parametrize(
    ("requested", "device", "backend", "installed", "expected"),
    [
        ("auto", "cpu", "torch", True, "host_copy"),
        ("auto", "cuda", "torch", True, "memory_saver"),
        ("auto", "cuda", "torch", False, "host_copy"),
        ("auto", "cuda", "megatron", True, "host_copy"),
        ("host_copy", "cuda", "torch", True, "host_copy"),
        ("host_copy", "cpu", "megatron", False, "host_copy"),
        ("memory_saver", "cuda", "torch", True, "memory_saver"),
        ("torch_memory_saver", "cuda", "torch", True, "memory_saver"),
        ("none", "cuda", "torch", True, "none"),
        ("none", "cpu", "megatron", False, "none"),
    ],
)
def test_offload_backend_by_device_and_config(
    monkeypatch: pytest.MonkeyPatch,
    requested: str,
    device: str,
    backend: str,
    installed: bool,
    expected: str,
) -> None:
    monkeypatch.setattr(_offload, "memory_saver_installed", lambda: installed)
    got = resolve_offload_backend(requested, device=torch.device(device), backend=backend)
    assert got == expected


@pytest.mark.parametrize(
    ("device", "backend", "installed", "why"),
    [
        ("cpu", "torch", True, "needs CUDA"),
        ("cuda", "torch", False, "needs the torch_memory_saver package"),
        ("cuda", "megatron", True, "not supported by the megatron backend"),
    ],
)
def test_memory_saver_is_refused_where_it_cannot_run_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, device: str, backend: str, installed: bool, why: str
) -> None:
    monkeypatch.setattr(_offload, "memory_saver_installed", lambda: installed)
    with pytest.raises(ValueError, match=why) as info:
        resolve_offload_backend(
            "memory_saver", device=device, backend=backend, key="policy.offload_backend"
        )
    text = str(info.value)
    assert text.startswith("policy.offload_backend='memory_saver'")
    assert "set policy.offload_backend='host_copy'" in text  # the fix


def test_one_spelling_memory_saver_and_the_lifecycle_name_is_an_alias() -> None:
    assert ActorConfig(offload_backend="torch_memory_saver").offload_backend == "memory_saver"
    assert ActorConfig(offload_backend="memory_saver").offload_backend == "memory_saver"
    with pytest.raises(ValueError, match=r"actor\.offload_backend='disk'"):
        ActorConfig(offload_backend="disk")
    with pytest.raises(ValueError, match="use 'auto', 'host_copy', 'memory_saver' or 'none'"):
        resolve_offload_backend("disk", device="cpu")


def test_cpu_workers_use_the_host_copy_and_refuse_the_memory_saver() -> None:
    actor = ActorWorker(actor_config("torch", kl_loss_coef=0.1))
    critic = CriticWorker(critic_config("torch"))
    for worker in (actor, critic):
        assert worker._backend.offload_backend == "host_copy"  # type: ignore[attr-defined]
        for model, _ in worker._models():
            assert isinstance(model.lifecycle.backend, HostCopyBackend)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"actor\.offload_backend='memory_saver' needs CUDA"):
        ActorWorker(actor_config("torch", offload_backend="memory_saver"))


@needs_megatron
def test_megatron_refuses_the_memory_saver_and_reads_auto_as_host_copy() -> None:
    with pytest.raises(ValueError, match="not supported by the megatron backend"):
        ActorWorker(actor_config("megatron", offload_backend="memory_saver"))
    worker = ActorWorker(actor_config("megatron"))
    assert worker._backend.offload_backend == "host_copy"  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- communicators


class FakeComm:
    """Stands for a ``ProcessGroupNCCL`` backend: counts suspends and resumes."""

    def __init__(self, name: str, *, refuse: bool = False) -> None:
        self.name = name
        self.refuse = refuse
        self.calls: list[str] = []
        self.is_suspended = False

    def suspend(self) -> None:
        if self.refuse:
            raise RuntimeError("NCCL Suspend failed (requires NCCL 2.29.7+)")
        assert not self.is_suspended, f"{self.name} suspended twice"
        self.calls.append("suspend")
        self.is_suspended = True

    def resume(self) -> None:
        assert self.is_suspended, f"{self.name} resumed while active"
        self.calls.append("resume")
        self.is_suspended = False


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh process-wide registry (workers of other tests stay registered as awake)."""
    fresh = _offload._Registry()
    monkeypatch.setattr(_offload, "_REGISTRY", fresh)
    return fresh


def test_communicators_are_suspended_while_every_model_of_the_process_sleeps(
    registry: Any,
) -> None:
    shared, own = FakeComm("world"), FakeComm("critic-only")
    actor = CommunicatorSuspender(lambda: [shared], name="actor")
    critic = CommunicatorSuspender(lambda: [shared, own], name="critic")

    assert actor.release() == 0  # the critic is awake and uses the shared group
    assert shared.calls == []
    assert critic.release() == 2  # now nobody needs them: each suspended once
    assert critic.release() == 0  # idempotent
    assert shared.calls == ["suspend"] and own.calls == ["suspend"]
    assert actor.suspended == 2

    assert actor.restore() == 2  # the first to wake resumes them before using them
    assert actor.restore() == 0  # idempotent (a wake_up on a resident worker)
    assert shared.calls == ["suspend", "resume"] and own.calls == ["suspend", "resume"]
    assert critic.restore() == 0
    assert actor.suspended == 0


def test_a_garbage_collected_model_no_longer_keeps_the_communicators(registry: Any) -> None:
    comm = FakeComm("world")
    gone = CommunicatorSuspender(lambda: [comm], name="reference")
    keeper = CommunicatorSuspender(lambda: [comm], name="actor")
    del gone  # finalised: it is not awake any more
    assert keeper.release() == 1


def test_a_refused_suspend_keeps_every_communicator_and_is_not_retried(
    registry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ok, old = FakeComm("ok"), FakeComm("old", refuse=True)
    model = CommunicatorSuspender(lambda: [ok, old], name="actor")
    with caplog.at_level(logging.WARNING, logger="ppo_trainer._offload"):
        assert model.release() == 0
    assert ok.calls == ["suspend", "resume"] and not ok.is_suspended  # rolled back
    assert "NCCL >= 2.29.7" in caplog.text
    assert model.restore() == 0
    assert model.release() == 0  # the process's choice is fixed: no second attempt
    assert ok.calls == ["suspend", "resume"]


class _CommWithoutSuspend:
    """A ``ProcessGroupNCCL`` of a torch without ``suspend()`` (torch 2.11, as on the
    lent H200): only ``resume`` would be reached by a rollback, and never is."""

    def resume(self) -> None:  # pragma: no cover - nothing was suspended
        raise AssertionError("resumed without a suspend")


def test_a_torch_without_suspend_keeps_the_communicators_with_a_warning(
    registry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ok = FakeComm("ok")
    model = CommunicatorSuspender(lambda: [ok, _CommWithoutSuspend()], name="actor")  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING, logger="ppo_trainer._offload"):
        assert model.release() == 0
    assert ok.calls == ["suspend", "resume"] and not ok.is_suspended  # rolled back
    assert f"torch {torch.__version__}" in caplog.text and "suspend" in caplog.text
    assert registry.unsupported
    assert model.restore() == 0 and model.release() == 0  # not retried
    assert ok.calls == ["suspend", "resume"]


def _backend_named(name: str, **attrs: Any) -> Any:
    """An object whose class has the name torch gives a CUDA backend class."""
    return type(name, (), attrs)()


class _Group:
    """A ``ProcessGroup`` stand-in: its CUDA backend, as ``_get_backend`` returns it."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def _get_backend(self, device: torch.device) -> Any:
        assert device.type == "cuda"
        return self.backend


def test_nccl_backends_are_found_behind_the_debug_wrapper_and_others_are_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # On CUDA, torch names the classes so: ProcessGroupNCCL; under
    # TORCH_DISTRIBUTED_DEBUG=DETAIL a _ProcessGroupWrapper with .wrapped_pg; under
    # TORCH_DIST_USE_NCCL2=1 a ProcessGroupNCCL2 (no _comm_ptr). The real classes run in
    # the gpu tests below.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_offload, "_UNSUPPORTED_NCCL", set())
    connected = {"_comm_ptr": lambda self: 0x1234}
    plain = _backend_named("ProcessGroupNCCL", **connected)
    inner = _backend_named("ProcessGroupNCCL", **connected)
    wrapper = _backend_named("_ProcessGroupWrapper", wrapped_pg=inner)
    lazy = _backend_named("ProcessGroupNCCL", _comm_ptr=lambda self: 0)  # never used
    nccl2 = _backend_named("ProcessGroupNCCL2")
    gloo = _backend_named("ProcessGroupGloo")
    groups = [_Group(b) for b in (plain, wrapper, lazy, nccl2, gloo, plain, nccl2)]
    with caplog.at_level(logging.WARNING, logger="ppo_trainer._offload"):
        found = _offload.nccl_communicators(groups)
    assert found == [plain, inner]  # in order, each once, the wrapped one unwrapped
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "ProcessGroupNCCL2" in warned[0], warned  # once per class
    assert "TORCH_DIST_USE_NCCL2" in warned[0]


def test_workers_call_the_hooks_on_first_sleep_and_every_wake_up(
    registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = FakeComm("world")
    worker = ActorWorker(actor_config("torch"))
    suspender = worker._backend.communicators  # type: ignore[attr-defined]
    monkeypatch.setattr(suspender, "_communicators", lambda: [comm])
    worker.sleep(parts=KEEP_GRADIENTS)
    worker.sleep()  # further parts: no second release
    assert comm.calls == ["suspend"]
    worker.wake_up()
    worker.wake_up()  # resident: restores only (nothing left to resume)
    assert comm.calls == ["suspend", "resume"]


def test_offload_none_keeps_everything_resident_and_the_bookkeeping(
    registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The report's --no-offload-train: sleep/wake_up move nothing and keep the process
    # groups; the worker's own bookkeeping (is_asleep) follows the calls as before.
    comm = FakeComm("world")
    worker = ActorWorker(actor_config("torch", offload_backend="none"))
    suspender = worker._backend.communicators  # type: ignore[attr-defined]
    monkeypatch.setattr(suspender, "_communicators", lambda: [comm])
    lifecycle = worker._policy.lifecycle  # type: ignore[attr-defined]
    before = lifecycle.device_bytes()
    weights = {k: v.clone() for k, v in worker._policy.module.state_dict().items()}  # type: ignore[attr-defined]
    worker.sleep()
    assert worker.is_asleep and lifecycle.device_bytes() == before > 0
    assert not lifecycle.is_asleep and comm.calls == []
    worker.wake_up()
    assert not worker.is_asleep and comm.calls == []
    after = worker._policy.module.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(after[k], v) for k, v in weights.items())


_GLOO_CHILD = textwrap.dedent(
    """
    import json
    import torch.distributed as dist
    from ppo_trainer import ActorWorker
    from ppo_trainer._offload import nccl_communicators, process_groups
    from trainer_testlib import actor_config

    # Two "ranks" would need two processes; one rank of a gloo group started the way
    # the backend starts one shows what the hooks see on CPU: gloo groups only.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    worker = ActorWorker(actor_config("torch"))
    groups = process_groups()
    worker.sleep()
    asleep = worker._backend.communicators.suspended
    worker.wake_up()
    print(json.dumps({"groups": len(groups), "nccl": len(nccl_communicators(groups)),
                      "suspended": asleep, "backend": dist.get_backend()}))
    """
)


def test_gloo_holds_no_device_memory_so_nothing_is_released() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _GLOO_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(__file__),
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"groups": 1, "nccl": 0, "suspended": 0, "backend": "gloo"}


# --------------------------------------------------------------------------- NCCL (GPU)

_NCCL_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from ppo_trainer import CommunicatorSuspender
    from ppo_trainer._offload import _REGISTRY, nccl_communicators, process_groups

    def stats(comm):  # ncclCommMemStats through torch: diagnostics, may be missing
        try:
            return dict(comm.memory_stats())
        except Exception as exc:
            return repr(exc)

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    lazy = len(nccl_communicators(process_groups()))  # 0: NCCL connects at first use
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    comms = nccl_communicators(process_groups())
    model = CommunicatorSuspender(lambda: nccl_communicators(process_groups()), name="actor")
    before = stats(comms[0])
    free_awake = torch.cuda.mem_get_info()[0]
    suspended = model.release()
    during = stats(comms[0])
    free_asleep = torch.cuda.mem_get_info()[0]
    resumed = model.restore()
    after = stats(comms[0])
    t.fill_(2.0)
    dist.all_reduce(t)  # the same group object works after the resume
    ok = bool((t == 2.0).all())
    dist.destroy_process_group()
    print(json.dumps({"comms": len(comms), "suspended": suspended, "resumed": resumed,
                      "before": before, "during": during, "after": after, "ok": ok,
                      "freed": free_asleep - free_awake, "lazy": lazy,
                      "refused": _REGISTRY.unsupported}))
    """
)


def _nccl_can_suspend() -> bool:
    """ncclCommSuspend needs NCCL >= 2.29.7 and torch's ProcessGroupNCCL.suspend (the
    lent H200 had torch 2.11 with NCCL 2.28.9: neither)."""
    from torch.distributed import ProcessGroupNCCL

    nccl = tuple(torch.cuda.nccl.version())
    return hasattr(ProcessGroupNCCL, "suspend") and nccl >= (2, 29, 7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])  # DETAIL: torch wraps the NCCL backend
def test_nccl_communicator_is_suspended_on_release_and_works_after_restore(debug: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NCCL_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_DISTRIBUTED_DEBUG": debug},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("NCCL suspend:", out)  # what the lent machine showed (nox -s gpu keeps the log)
    assert out["comms"] == 1
    if not _nccl_can_suspend():  # refused once, with the reason; the group still works
        assert out["suspended"] == 0 and out["resumed"] == 0 and out["refused"], out
        assert out["ok"]
        return
    assert out["suspended"] == 1 and out["resumed"] == 1 and not out["refused"]
    if isinstance(out["during"], dict):  # ncclCommMemStats' "suspended" flag
        assert out["during"]["suspended"] == 1 and out["after"]["suspended"] == 0, out
    assert out["freed"] >= 0
    assert out["ok"]


_MEGATRON_NCCL_CHILD = textwrap.dedent(
    """
    import json
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from ppo_trainer import ActorConfig, ActorWorker, CriticConfig, CriticWorker, ModelSpec

    spec = ModelSpec(seed=3)
    actor = ActorWorker(ActorConfig(model=spec, backend="megatron"))
    critic = CriticWorker(CriticConfig(model=spec, backend="megatron"))
    t = torch.ones(4, device="cuda")
    for group in (None, ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()):
        dist.all_reduce(t, group=group)  # give the groups their communicators
    torch.cuda.synchronize()
    out = {}
    actor.sleep()
    out["actor_asleep"] = actor._backend.communicators.suspended  # critic awake: kept
    critic.sleep()
    out["both_asleep"] = critic._backend.communicators.suspended
    actor.wake_up()
    out["actor_awake"] = actor._backend.communicators.suspended
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    out["ok"] = bool((t == 1.0).all())
    critic.wake_up()
    print(json.dumps(out))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_megatron
def test_megatron_groups_are_suspended_only_while_actor_and_critic_both_sleep() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _MEGATRON_NCCL_CHILD], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("megatron NCCL suspend:", out)
    assert out["actor_asleep"] == 0
    assert out["both_asleep"] >= (1 if _nccl_can_suspend() else 0)
    assert out["actor_awake"] == 0
    assert out["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_the_memory_saver_on_cuda_when_installed() -> None:
    from ppo_lifecycle import TorchMemorySaverBackend

    installed = _offload.memory_saver_installed()
    first = ActorWorker(actor_config("torch", device="cuda"))
    second = ActorWorker(actor_config("torch", device="cuda"))  # tags of its own
    for worker in (first, second):
        backend = worker._policy.lifecycle.backend  # type: ignore[attr-defined]
        if installed:
            assert worker._backend.offload_backend == "memory_saver"  # type: ignore[attr-defined]
            assert isinstance(backend, TorchMemorySaverBackend)
        else:
            assert isinstance(backend, HostCopyBackend)
    before = {k: v.clone() for k, v in first.export_weights().items()}
    first.sleep()
    second.sleep()
    first.wake_up()
    after = first.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
