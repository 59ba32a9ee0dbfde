"""SIGINT and SIGTERM during ``train``: a clean stop (:class:`RunStopped`) after the
checkpoint being written, if one is."""

from __future__ import annotations

import logging
import signal
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("ppo_driver")


class RunStopped(BaseException):
    """``train`` stopped on SIGINT or SIGTERM after a clean teardown (workers, engines and
    Ray shut down, no checkpoint half-written). Like ``KeyboardInterrupt``, not an
    ``Exception``. ``exit_code``: 128 + the signal number (130, 143)."""

    def __init__(self, signum: int, *, run_dir: Path, checkpoint: Path | None) -> None:
        self.signum, self.run_dir, self.checkpoint = signum, run_dir, checkpoint
        super().__init__(f"stopped by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Interrupt(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler of a running ``train``."""


class _SignalGuard:
    """SIGINT and SIGTERM stop ``train`` cleanly: the first one raises :class:`_Interrupt`
    in the main thread (after the checkpoint being written, if one is), later ones only
    log while the teardown runs. Main thread only (elsewhere Python allows no handlers);
    installed again after ``ray.init``, which sets its own SIGTERM handler (an exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._raised = False
        self._defer = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            log.warning("%s: already stopping (shutting down); SIGKILL forces an exit", name)
            return
        self.received = signum
        if self._defer:
            log.warning("%s: stopping once the checkpoint being written is complete", name)
            return
        log.warning("%s: stopping; shutting down the workers, the engines and Ray", name)
        self._raise()

    def _raise(self) -> None:
        self._raised = True
        raise _Interrupt(self.received)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal arriving inside takes effect when the block completes."""
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
        if not self._defer and self.received is not None and not self._raised:
            log.warning("checkpoint complete; stopping")
            self._raise()
