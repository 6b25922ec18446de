"""SIGTERM, SIGINT, SIGHUP -> finish the step, save, leave. The handler only sets a flag; the loop acts on it.

torchrun's agent sends SIGTERM when it restarts the worker group (a node joined or failed) and when it is
itself stopped (preemption); SIGKILL follows 30 s later. A worker that saves within that window loses no
completed step. SIGHUP (the terminal or SSH session of a run started by hand closed) is a request to stop
like the others: by default it killed the process on the spot, losing every step since the last save.
The agent watchdog asks for a stop through the same flag when the worker's agent dies.

A signal never cuts a save short: the handler only sets the flag, so a SIGTERM that arrives during an
emergency save (the agents send it as they die, e.g. when the c10d store host is lost) waits for the save,
which is bounded by checkpoint.emergency_retry_for, inside torchrun's 30 s before its SIGKILL. The agent
watchdog's hard exit likewise waits while `saving` says a save is in flight (see watchdog.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequest:
    """A stop flag set by SIGTERM/SIGINT/SIGHUP (or by `request`), read by the training loop.

    The handler runs in the main thread between two bytecodes, possibly while that thread holds a lock
    (the log writer's, an Event's condition): it must take none, so it only assigns attributes, and the
    loop logs `stop_requested` when it next looks (`notice`). A handler that logged deadlocked a worker
    that the signal caught inside a log write: its peers then waited in a collective until torchrun's
    SIGKILL, 30 s later, and the steps since the last checkpoint were lost.
    """

    def __init__(self) -> None:
        self._requested = False
        self._noticed = False
        self.signal_name: str | None = None
        self.signum: int | None = None  # the first signal that asked for the stop; None for `request`
        self.received_ts: float | None = None
        self._previous: dict[int, Any] = {}
        self._save_done = threading.Event()  # set while no save that must finish is in flight
        self._save_done.set()

    def install(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        """Take the stop signals (until `uninstall`). Only the main thread may: run from another thread
        (the Python API under a web server, a notebook's background thread) only `request` stops."""
        if threading.current_thread() is not threading.main_thread():
            return
        # Python starts with SIGPIPE ignored (a write to a closed pipe raises EPIPE, which the console and
        # the log writer drop); make sure no library has put back the default, which kills silently.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self._requested:  # plain attribute stores: no lock, no I/O
            self.signal_name = signal.Signals(signum).name
            self.signum = signum
            self.received_ts = time.time()
        self._requested = True

    def request(self, reason: str) -> None:
        """Ask for a stop from code (a thread may call this: it only stores attributes)."""
        if not self._requested:
            self.signal_name = reason
            self.received_ts = time.time()
        self._requested = True

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Marks a stop or emergency save in flight: a hard exit waits for it (`wait_for_save`)."""
        self._save_done.clear()
        try:
            yield
        finally:
            self._save_done.set()

    def wait_for_save(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a save in flight to end; whether none is in flight now."""
        return self._save_done.wait(timeout_s)

    @property
    def requested(self) -> bool:
        return self._requested

    def notice(self, log: Any) -> bool:
        """Whether a stop was requested; logs `stop_requested` the first time it is seen."""
        if self._requested and not self._noticed:
            self._noticed = True
            log.warning("stop_requested", signal=self.signal_name, received_ts=self.received_ts)
        return self._requested
