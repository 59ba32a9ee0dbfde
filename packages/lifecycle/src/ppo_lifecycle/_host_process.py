"""A small child process that holds host memory for this one (Linux).

A CPU "device" worker cannot keep a sleeping model's host copy in its own memory: its
resident set *is* the device memory. So the copy goes to a child process started for
the purpose (``python -I -S -c <_CHILD_SOURCE>``: the standard library only, no torch,
never a ``fork`` of this process). On request, over a pipe, the child maps anonymous
memory with ``madvise(MADV_HUGEPAGE)`` (2 MiB transparent huge pages where the kernel
gives them: one page fault and one free per 2 MiB instead of per 4 KiB, which is what
makes this faster than ``memfd`` files whose shared memory uses 4 KiB pages) and
reports its address; this process then copies straight into and out of it with
``process_vm_writev`` / ``process_vm_readv`` (one copy, many buffers per call).

The child ends when this process closes the pipe (the last user of
:class:`HostProcess` is garbage-collected, or the process dies: the kernel closes its
files), and, when started from the main thread, is also killed by the kernel when
this process dies (``PR_SET_PDEATHSIG``). It is reaped by :meth:`HostProcess.close`.

Where the child cannot be started or written to (``ptrace`` restrictions: Yama
``ptrace_scope`` >= 2, a seccomp profile without ``process_vm_writev``, no
``sys.executable``), :func:`shared_host_process` returns ``None`` with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["HostProcess", "HostProcessError", "shared_host_process"]

#: At most this many buffers go to one ``process_vm_writev``/``readv`` (``IOV_MAX``).
_IOV_MAX = 1024

_CHILD_SOURCE = r"""
import ctypes, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the parent
libc = ctypes.CDLL(None, use_errno=True)
parent, deathsig = int(sys.argv[1]), int(sys.argv[2])
if deathsig:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(0)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20
PROT_RW, MAP_PRIVATE_ANON, MADV_HUGEPAGE = 0x3, 0x02 | 0x20, 14
regions = {}  # address -> bytes
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    cmd, *args = line.split()
    if cmd == b"alloc":  # -> "ok <address>": n bytes, 2 MiB aligned, huge pages advised
        n = int(args[0])
        span = n + HUGE
        base = libc.mmap(None, span, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
        if base is None or base == ctypes.c_void_p(-1).value:
            out.write(b"err %d\n" % ctypes.get_errno())
        else:
            start = -(-base // HUGE) * HUGE
            if start > base:
                libc.munmap(base, start - base)
            if base + span > start + n:
                libc.munmap(start + n, base + span - start - n)
            libc.madvise(start, n, MADV_HUGEPAGE)  # a kernel without THP: 4 KiB pages
            regions[start] = n
            out.write(b"ok %d\n" % start)
    elif cmd == b"free":  # no answer: the caller does not wait for the unmapping
        n = regions.pop(int(args[0]), 0)
        if n:
            libc.munmap(int(args[0]), n)
        continue
    elif cmd == b"check":  # -> "ok" if the region is held with at least that many bytes
        held = regions.get(int(args[0]), -1) >= int(args[1])
        out.write(b"ok\n" if held else b"err 0\n")
    else:
        out.write(b"err 22\n")
    out.flush()
"""


class HostProcessError(OSError):
    """The host-memory process refused a request or is gone."""


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind(name: str) -> Any:
    """``process_vm_writev``/``readv`` from the C library (``None`` if it has none)."""
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return call


# Module attributes (not bound methods) so that tests can stand in for the kernel.
_vm_write: Any = _bind("process_vm_writev")
_vm_read: Any = _bind("process_vm_readv")


def transfer(call: Any, pid: int, pieces: Sequence[tuple[int, int]], remote: int) -> int:
    """Move ``pieces`` (``(address, length)`` in this process), back to back from
    ``remote`` in process ``pid``, through ``call`` (:data:`_vm_write` or
    :data:`_vm_read`): up to ``_IOV_MAX`` buffers per system call, resuming after a
    partial transfer. Returns the bytes moved; fewer than ``pieces`` hold only where a
    call moved nothing. Raises ``OSError`` with the call's ``errno`` when it fails."""
    pending = [p for p in pieces if p[1] > 0]
    first = moved = 0
    while first < len(pending):
        batch = pending[first : first + _IOV_MAX]
        local = (_IOVec * len(batch))(*(_IOVec(a, n) for a, n in batch))
        far = _IOVec(remote + moved, sum(length for _, length in batch))
        got = int(call(pid, local, len(batch), ctypes.byref(far), 1, 0))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{getattr(call, '__name__', 'process_vm')}: {os.strerror(err)}")
        if got == 0:
            break
        moved += got
        while first < len(pending) and got >= pending[first][1]:
            got -= pending[first][1]
            first += 1
        if got:
            address, length = pending[first]
            pending[first] = (address + got, length - got)
    return moved


def _end(proc: subprocess.Popen[bytes], owner: int) -> None:
    """Close the child's pipe (it exits at the end of its input) and reap it."""
    if os.getpid() != owner:  # pragma: no cover - a forked copy of the owner: not its child
        return
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a child stuck in the kernel
        proc.kill()
        proc.wait()


class HostProcess:
    """A child process that maps memory on request for this process to copy into.

    Requests are serialised (one lock); the copies themselves go straight from this
    process's memory to the child's, from any number of threads at once.
    """

    def __init__(self) -> None:
        if not sys.executable:
            raise HostProcessError("no sys.executable to start a host-memory process with")
        main = threading.current_thread() is threading.main_thread()
        # PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so only
        # the main thread asks for it; the pipe's end stops the child in every case.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD_SOURCE, str(os.getpid()), str(int(main))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.pid = self._proc.pid
        self._lock = threading.Lock()
        self._unread = 0  # answers not read yet (a caller interrupted while waiting)
        self._finalizer = weakref.finalize(self, _end, self._proc, os.getpid())

    def _ask(self, request: str, *, answer: bool = True) -> int:
        """Send one request; return the number after ``ok`` (0 if none)."""
        with self._lock:
            stdin: IO[bytes] | None = self._proc.stdin
            stdout: IO[bytes] | None = self._proc.stdout
            if stdin is None or stdout is None or stdin.closed:
                raise HostProcessError(f"host-memory process {self.pid} is closed")
            try:
                while self._unread:  # answers to requests whose caller was interrupted
                    stdout.readline()
                    self._unread -= 1
                stdin.write(request.encode() + b"\n")
                stdin.flush()
                reply = [b"ok"]
                if answer:
                    self._unread += 1
                    reply = stdout.readline().split()
                    self._unread -= 1
            except (OSError, ValueError) as exc:
                raise HostProcessError(
                    f"host-memory process {self.pid} is gone ({exc}); what it held is lost"
                ) from exc
        if not reply:
            raise HostProcessError(
                f"host-memory process {self.pid} exited (code {self._proc.poll()}); "
                "what it held is lost"
            )
        if reply[0] != b"ok":
            err = int(reply[1]) if len(reply) > 1 else 0
            raise HostProcessError(
                err, f"host-memory process {self.pid}: {request.split()[0]}: {os.strerror(err)}"
            )
        return int(reply[1]) if len(reply) > 1 else 0

    def alloc(self, nbytes: int) -> int:
        """Map ``nbytes`` (> 0) in the child; returns their address there."""
        return self._ask(f"alloc {nbytes}")

    def free(self, address: int) -> None:
        """Unmap a region from :meth:`alloc` (the child does it; this does not wait)."""
        self._ask(f"free {address}", answer=False)

    def check(self, address: int, nbytes: int) -> None:
        """Raise :class:`HostProcessError` unless the child is alive and holds ``nbytes``
        at ``address`` (so a copy never goes to a process that took over its pid)."""
        self._ask(f"check {address} {nbytes}")

    def write(self, pieces: Sequence[tuple[int, int]], remote: int) -> int:
        return transfer(_vm_write, self.pid, pieces, remote)

    def read(self, pieces: Sequence[tuple[int, int]], remote: int) -> int:
        return transfer(_vm_read, self.pid, pieces, remote)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self._proc.poll() is None

    def close(self) -> None:
        """End and reap the child (what it holds is freed)."""
        self._finalizer()


_lock = threading.Lock()
_shared: weakref.ref[HostProcess] | None = None
_unavailable: str | None = None


def _probe(host: HostProcess) -> None:
    """One small write and read back: raises where this process may not copy into it."""
    if _vm_write is None or _vm_read is None:
        raise HostProcessError("the C library has no process_vm_writev/process_vm_readv")
    sent = ctypes.create_string_buffer(b"ppo_lifecycle", 16)
    back = ctypes.create_string_buffer(16)
    remote = host.alloc(16)
    try:
        for call, buf in ((host.write, sent), (host.read, back)):
            if call([(ctypes.addressof(buf), 16)], remote) != 16:
                raise HostProcessError("process_vm_writev/readv moved nothing")
        if back.raw != sent.raw:
            raise HostProcessError("process_vm_readv read back other bytes than written")
    finally:
        host.free(remote)


def shared_host_process() -> tuple[HostProcess | None, str]:
    """This process's host-memory child, started (and checked) at the first call and
    shared by every caller while one holds it; ``(None, reason)`` where it cannot work
    here (the reason is kept: later calls do not try again)."""
    global _shared, _unavailable
    with _lock:
        if _unavailable is not None:
            return None, _unavailable
        host = _shared() if _shared is not None else None
        if host is not None and host.alive:
            return host, ""
        try:
            host = HostProcess()
        except OSError as exc:
            _unavailable = f"cannot start a host-memory process: {exc}"
            return None, _unavailable
        try:
            _probe(host)
        except OSError as exc:
            host.close()
            _unavailable = f"cannot copy into a host-memory process: {exc}"
            return None, _unavailable
        _shared = weakref.ref(host)
        return host, ""
