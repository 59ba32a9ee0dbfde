"""The CPU host copy kept in a host-memory child process, and the memfd fallback."""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lifecycle_models import (
    TinyLM,
    assert_a_failed_sleep_kept_everything,
    assert_bit_exact,
    batch,
    loss_fn,
    make,
    snapshot,
)
from ppo_lifecycle import (
    KEEP_GRADIENTS,
    HostCopyBackend,
    OffloadManager,
    Part,
    _backends,
    _host_process,
)
from ppo_lifecycle._backends import _ProcessSpill, _Spill
from ppo_lifecycle._host_process import HostProcessError

CPU = torch.device("cpu")


def _trained() -> tuple[TinyLM, torch.optim.Adam]:
    model, opt = make()
    loss_fn(model, batch(1)).backward()
    opt.step()
    loss_fn(model, batch(2)).backward()  # accumulated, un-applied gradients
    return model, opt


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """``pid`` has ended (exited and reaped, or a zombie left to another parent)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def own_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test starts its own host process (none shared with earlier tests)."""
    monkeypatch.setattr(_host_process, "_shared", None)
    monkeypatch.setattr(_host_process, "_unavailable", None)
    monkeypatch.setattr(_backends, "_fallback_logged", False)
    yield
    gc.collect()


def _spill(backend: HostCopyBackend, part: Part) -> _ProcessSpill:
    spill = backend._spills[part]
    assert isinstance(spill, _ProcessSpill)
    return spill


def test_split_cuts_spans_into_back_to_back_runs() -> None:
    spans = [(1000, 5), (2000, 0), (3000, 7), (4000, 1)]
    runs = _backends._split(spans, 3)
    assert [offset for _, offset in runs] == [0, 5, 10]
    assert runs[0][0] == [(1000, 5)]
    assert runs[1][0] == [(3000, 5)]
    assert runs[2][0] == [(3005, 2), (4000, 1)]
    assert _backends._split(spans, 1) == [([(1000, 5), (3000, 7), (4000, 1)], 0)]
    big = [(0, 3 * _backends._HUGE_PAGE + 1)]  # shares are whole huge pages
    assert [o for _, o in _backends._split(big, 3)] == [0, 2 * _backends._HUGE_PAGE]


def _count_spill_jobs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list each ``_Spill._in_parallel`` call appends its job count to (the copy
    still runs)."""
    jobs: list[int] = []
    real = _Spill._in_parallel

    def counted(batch: Any) -> None:
        jobs.append(len(batch))
        real(batch)

    monkeypatch.setattr(_Spill, "_in_parallel", staticmethod(counted))
    return jobs


def test_round_trip_through_the_host_process_is_bit_exact_and_frees_the_copy(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    monkeypatch.setattr(_backends, "_SPILL_CHUNK", 100)  # several threads per part
    jobs = _count_spill_jobs(monkeypatch)
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_files=3)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    total = manager.device_bytes()
    manager.sleep(parts=KEEP_GRADIENTS)
    assert backend.spill_kind == "process"
    assert max(jobs) == 3  # three threads on disjoint runs
    manager.sleep()
    assert backend.host_bytes() == total
    held = [(s._state["address"], s.nbytes()) for s in backend._spills.values()]
    host = _spill(backend, Part.PARAMETERS).host
    manager.wake_up()
    assert backend.host_bytes() == 0
    assert_bit_exact(before, snapshot(model, opt))
    for address, nbytes in held:  # the child unmapped every region
        with pytest.raises(HostProcessError, match="check"):
            host.check(address, nbytes)


def test_short_transfers_are_resumed_and_batched(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    """At most ``_IOV_MAX`` buffers per call; a partial transfer resumes where it stopped."""
    monkeypatch.setattr(_host_process, "_IOV_MAX", 3)
    calls = {"write": 0, "read": 0}

    def halves(name: str, real: Any) -> Any:
        def call(pid: int, local: Any, count: int, far: Any, one: int, flags: int) -> int:
            calls[name] += 1
            assert count <= 3
            head = _host_process._IOVec(local[0].base, max(1, local[0].len // 2))
            return int(real(pid, ctypes.byref(head), 1, far, one, flags))

        return call

    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process", spill_files=1)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    count = len({t.untyped_storage()._cdata for t in manager._inventory()[Part.PARAMETERS]})
    assert count > 3
    with monkeypatch.context() as patch:
        patch.setattr(_host_process, "_vm_write", halves("write", _host_process._vm_write))
        patch.setattr(_host_process, "_vm_read", halves("read", _host_process._vm_read))
        manager.sleep()
        manager.wake_up()
    assert calls["write"] > count and calls["read"] > count  # halves, resumed
    assert_bit_exact(before, snapshot(model, opt))


def _failing(err: int, *, on_call: int = 1) -> Any:
    calls = [0]
    real = _host_process._vm_read

    def call(*args: Any) -> int:
        calls[0] += 1
        if calls[0] >= on_call:
            ctypes.set_errno(err)
            return -1
        return int(real(*args))

    return call


def test_failed_write_moves_nothing_and_frees_the_region(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process")
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    resident = manager.device_bytes()
    manager.sleep(parts={Part.GRADIENTS})  # the host process is started (and checked)
    manager.wake_up()
    with monkeypatch.context() as patch:
        patch.setattr(_host_process, "_vm_write", _failing(errno.ENOMEM))
        with pytest.raises(OSError, match="Cannot allocate memory"):
            manager.sleep()
    assert backend.host_bytes() == 0
    assert_a_failed_sleep_kept_everything(manager, model, opt, before, resident)


def _asleep_in_the_host_process() -> tuple[
    torch.nn.Module, torch.optim.Optimizer, HostCopyBackend, OffloadManager, dict[str, torch.Tensor]
]:
    """A trained model, its snapshot, and the model put to sleep into the host process."""
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process")
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    manager.sleep()
    return model, opt, backend, manager, before


def test_failed_wake_up_is_retried_from_the_host_process(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    model, opt, backend, manager, before = _asleep_in_the_host_process()
    with monkeypatch.context() as patch:
        patch.setattr(_host_process, "_vm_read", _failing(errno.EIO, on_call=2))
        with pytest.raises(OSError, match="Input/output error"):
            manager.wake_up()
    assert manager.is_asleep and backend.host_bytes() > 0  # the copy is kept
    manager.wake_up()
    assert not manager.is_asleep and backend.host_bytes() == 0
    assert_bit_exact(before, snapshot(model, opt))


def test_a_killed_host_process_fails_the_wake_up_loudly_and_is_replaced(
    own_host: None,
) -> None:
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process")
    manager = OffloadManager(model, opt, backend=backend)
    manager.sleep(parts={Part.PARAMETERS})
    host = _spill(backend, Part.PARAMETERS).host
    os.kill(host.pid, signal.SIGKILL)
    assert _gone(host.pid)
    with pytest.raises(HostProcessError, match="what it held is lost"):
        manager.wake_up()
    assert manager.is_asleep
    # Awake parts still go to a new host process (the lost one stays lost).
    manager.sleep(parts={Part.OPTIMIZER})
    fresh = _spill(backend, Part.OPTIMIZER).host
    assert fresh.pid != host.pid and fresh.alive


def test_host_process_is_reaped_when_its_last_backend_goes(own_host: None) -> None:
    model, opt = _trained()
    backend = HostCopyBackend(CPU)
    other = HostCopyBackend(CPU)
    OffloadManager(model, opt, backend=backend).sleep(parts={Part.PARAMETERS})
    OffloadManager(*make(), backend=other).sleep(parts={Part.PARAMETERS})
    host = _spill(backend, Part.PARAMETERS).host
    assert _spill(other, Part.PARAMETERS).host is host  # one per process, shared
    pid, ref = host.pid, weakref.ref(host)
    del host, backend
    gc.collect()
    assert ref() is not None and ref().alive  # type: ignore[union-attr]
    del other
    gc.collect()
    assert ref() is None
    with pytest.raises(ChildProcessError):  # exited and reaped: no zombie left
        os.waitpid(pid, os.WNOHANG)
    assert _gone(pid, timeout=0)


_DIES = """
import importlib.util, os, signal, sys, ctypes
spec = importlib.util.spec_from_file_location("hp", sys.argv[1])
hp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hp)
host = hp.HostProcess()
buf = ctypes.create_string_buffer(1 << 20)
address = host.alloc(1 << 20)
assert host.write([(ctypes.addressof(buf), 1 << 20)], address) == 1 << 20
print(host.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "other-thread"])
def test_host_process_dies_with_its_parent(thread: bool) -> None:
    source = _DIES
    if thread:  # started from a thread that ends first: only the pipe's end stops it
        source = source.replace(
            "host = hp.HostProcess()",
            (
                "import threading\n"
                "box = []\n"
                "t = threading.Thread(target=lambda: box.append(hp.HostProcess()))\n"
                "t.start(); t.join()\n"
                "host = box[0]"
            ),
        )
    done = subprocess.run(
        [sys.executable, "-c", source, _host_process.__file__],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _gone(int(done.stdout.split()[0]))


def test_fallback_to_memfd_where_the_host_process_is_refused(
    monkeypatch: pytest.MonkeyPatch, own_host: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Yama ptrace_scope >= 2 or seccomp: process_vm_writev fails with EPERM."""
    monkeypatch.setattr(_host_process, "_vm_write", _failing(errno.EPERM))
    model, opt = _trained()
    before = snapshot(model, opt)
    strict = OffloadManager(model, opt, backend=HostCopyBackend(CPU, spill_to="process"))
    with pytest.raises(HostProcessError, match="Operation not permitted"):
        strict.sleep()
    assert not strict.is_asleep
    with caplog.at_level(logging.WARNING, logger="ppo_lifecycle"):
        for _ in range(2):  # logged once, whatever the number of backends
            backend = HostCopyBackend(CPU)
            manager = OffloadManager(model, opt, backend=backend)
            manager.sleep()
            assert backend.spill_kind == "memfd"
            assert isinstance(backend._spills[Part.PARAMETERS], _Spill)
            manager.wake_up()
            assert_bit_exact(before, snapshot(model, opt))
    warnings = [r for r in caplog.records if "memfd" in r.getMessage()]
    assert len(warnings) == 1 and "Operation not permitted" in warnings[0].getMessage()


def test_an_answer_left_unread_by_an_interrupted_caller_is_skipped() -> None:
    host = _host_process.HostProcess()
    try:
        assert host._proc.stdin is not None
        host._proc.stdin.write(b"check 1 1\n")  # as if its caller died waiting for "err"
        host._proc.stdin.flush()
        host._unread = 1
        address = host.alloc(4096)
        host.check(address, 4096)
        assert host._unread == 0
    finally:
        host.close()
    assert not host.alive
    with pytest.raises(HostProcessError, match="closed"):
        host.alloc(4096)


def test_a_wake_up_that_restored_everything_succeeds_even_if_the_free_fails(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    model, opt, backend, manager, before = _asleep_in_the_host_process()

    def gone(self: object, address: int) -> None:
        raise HostProcessError("host-memory process is gone")

    monkeypatch.setattr(_host_process.HostProcess, "free", gone)
    manager.wake_up()
    assert not manager.is_asleep and backend.host_bytes() == 0
    assert_bit_exact(before, snapshot(model, opt))


def test_a_cached_host_copy_keeps_its_region_until_its_size_changes(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    """With ``cache_host_buffers`` the region stays held while awake and the next sleep
    of the same bytes writes into it (no new allocation); a part that shrank gets a
    region of its new size, and the old one is freed."""
    host, reason = _host_process.shared_host_process()  # started (its own check) first
    assert host is not None, reason
    allocs: list[int] = []
    real = _host_process.HostProcess.alloc

    def counted(self: _host_process.HostProcess, nbytes: int) -> int:
        allocs.append(nbytes)
        return real(self, nbytes)

    monkeypatch.setattr(_host_process.HostProcess, "alloc", counted)
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process", cache_host_buffers=True)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    grads = manager.part_bytes()[Part.GRADIENTS]
    manager.sleep(parts={Part.GRADIENTS})
    manager.wake_up()
    spill = _spill(backend, Part.GRADIENTS)
    first = spill._state["address"]
    assert allocs == [grads] and spill.nbytes() == grads  # held while awake
    manager.sleep(parts={Part.GRADIENTS})
    assert allocs == [grads] and spill._state["address"] == first
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))

    model.hidden.weight.grad = None
    before = snapshot(model, opt)
    left = manager.part_bytes()[Part.GRADIENTS]
    manager.sleep(parts={Part.GRADIENTS})
    assert allocs == [grads, left] and backend.host_bytes() == left
    assert spill.host is host
    with pytest.raises(HostProcessError, match="check"):  # the old region is gone
        host.check(first, grads)
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_a_host_process_that_ended_holding_nothing_is_replaced_at_the_next_sleep(
    own_host: None,
) -> None:
    """A part woken up keeps its spill (its region freed); if the host process ends
    meanwhile, the part's next sleep goes to a new one instead of failing."""
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process")
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    manager.sleep(parts={Part.PARAMETERS})
    manager.wake_up()
    spill = _spill(backend, Part.PARAMETERS)
    host = spill.host
    os.kill(host.pid, signal.SIGKILL)
    assert _gone(host.pid)
    manager.sleep(parts={Part.PARAMETERS})
    assert _spill(backend, Part.PARAMETERS) is spill
    assert spill.host.pid != host.pid and spill.host.alive
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))


def test_a_part_smaller_than_a_chunk_is_copied_without_threads(
    monkeypatch: pytest.MonkeyPatch, own_host: None
) -> None:
    """Threads share a copy by chunks of ``_SPILL_CHUNK``: a part smaller than one is
    one job (no thread pool), whatever ``spill_files`` allows."""
    jobs = _count_spill_jobs(monkeypatch)
    model, opt = _trained()
    backend = HostCopyBackend(CPU, spill_to="process", spill_files=3)
    manager = OffloadManager(model, opt, backend=backend)
    before = snapshot(model, opt)
    assert manager.device_bytes() < _backends._SPILL_CHUNK
    manager.sleep()
    manager.wake_up()
    assert jobs and set(jobs) == {1}  # one per part and direction
    assert_bit_exact(before, snapshot(model, opt))
