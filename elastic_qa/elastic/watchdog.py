"""Stop a worker whose torchrun agent has died, instead of letting it train on alone.

torchrun starts workers as children of the agent. When the agent is SIGKILLed its workers are re-parented
(to init or a subreaper) and would otherwise keep training as a group of their own: a split brain that
also leaves the other agents waiting 300 s in their exit barrier.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

from elastic_qa.observe.log import get_logger

EXIT_AGENT_LOST = 76


class AgentWatchdog:
    def __init__(self, interval: timedelta) -> None:
        self.interval_s = interval.total_seconds()
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if os.getppid() != self.parent:
                get_logger().error("agent_lost", parent_pid=self.parent)
                # os._exit: no cleanup that could block (a collective, a flush to dead storage).
                os._exit(EXIT_AGENT_LOST)
