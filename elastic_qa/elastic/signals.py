"""SIGTERM -> finish the step, save, leave. The handler only sets a flag; the loop acts on it.

torchrun's agent sends SIGTERM when it restarts the worker group (a node joined or failed) and when it is
itself stopped (preemption); SIGKILL follows 30 s later. A worker that saves within that window loses no
completed step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from elastic_qa.observe.log import get_logger


class StopRequest:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self._event.is_set():
            self.signal_name = signal.Signals(signum).name
            get_logger().warning("stop_requested", signal=self.signal_name)
        self._event.set()

    def request(self, reason: str) -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()
