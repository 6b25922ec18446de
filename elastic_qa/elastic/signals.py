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
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from elastic_qa.observe.events import Event

if TYPE_CHECKING:  # a type only: structlog is not imported here for it
    from elastic_qa.observe.log import EventLog

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

    def notice(self, log: EventLog) -> bool:
        """Whether a stop was requested; logs `stop_requested` the first time it is seen."""
        if self._requested and not self._noticed:
            self._noticed = True
            log.warning(Event.STOP_REQUESTED, signal=self.signal_name, received_ts=self.received_ts)
        return self._requested


class SignalWait:
    """Blocks the main thread until one of `signals` arrives, taking no lock a signal handler could need.

    A wait on a `threading.Event` set by the handler hangs for good when a second signal lands while the
    main thread holds the Event's lock inside `wait()` (a server sent Ctrl-C then SIGTERM never stopped):
    the handler's `set()` waits for a lock its own thread holds. Here the interpreter's C-level handler
    writes each signal's number to a socket (`signal.set_wakeup_fd`), the main thread blocks reading that
    socket, and the Python-level handler does nothing at all. Use as a context manager, from the main
    thread; leaving it puts back the previous handlers and wakeup fd.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalWait: signal handlers can only be set from the main thread")
        self._signals = {int(s) for s in signals}
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # the interpreter drops a byte rather than block in its handler
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._previous = {signum: signal.signal(signum, _do_nothing) for signum in self._signals}

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The number of the first of the signals to arrive (at once if one already has since the last
        call), or None after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._reader.settimeout(left)
            try:
                received = self._reader.recv(64)
            except TimeoutError:
                return None
            for signum in received:  # other handled signals write their numbers here too
                if signum in self._signals:
                    return signum

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._reader.close()
        self._writer.close()

    def __enter__(self) -> SignalWait:
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _value: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()


def _do_nothing(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler of `SignalWait`: the wakeup fd carries the signal, this only keeps the
    default action (termination) from running."""
