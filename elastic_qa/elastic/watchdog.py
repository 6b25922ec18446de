"""Stop a worker whose torchrun agent has died, instead of letting it train on alone.

torchrun starts workers as children of the agent. When the agent is SIGKILLed its workers are re-parented
(to init or a subreaper) and would otherwise keep training as a group of their own: a split brain that
also leaves the other agents waiting 300 s in their exit barrier.

The watchdog only watches a process that a torchrun agent started. A single process run by hand has no
agent: its parent is a shell, and a shell that exits (`nohup ... &`, `setsid`, a closed SSH session) is
no reason to stop. Stopping the orphan of a dead agent once killed it on the spot with os._exit and lost
every step since the last checkpoint; it now asks the loop to stop (the group agrees on the next control
step and rank 0 saves, or a collective fails and the emergency path saves) and only exits with 76
regardless if the process is still there after `dist.agent_lost_grace`, or, when a stop or emergency save
is in flight then, once that save ends (at most `save_limit` more: the save's own retry bound).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta

from elastic_qa.elastic.signals import StopRequest
from elastic_qa.exits import EXIT_AGENT_LOST
from elastic_qa.liveness import agent_lineage, lineage_intact
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger


class AgentWatchdog:
    """Watches the parent that the process had at start (construct it first thing): when the parent
    changes, the agent has died. Inactive when no torchrun agent started the process."""

    def __init__(
        self,
        interval: timedelta,
        grace: timedelta,
        stop_request: StopRequest,
        save_limit: timedelta = timedelta(0),
    ) -> None:
        self.interval_s = interval.total_seconds()
        self.grace_s = grace.total_seconds()
        self.save_limit_s = save_limit.total_seconds()
        self.stop_request = stop_request
        self.lineage = agent_lineage()  # [agent], or [forkserver, agent] for a warm worker
        self.parent = self.lineage[-1] if self.lineage else None  # the agent
        self.lost = False  # the agent died: the process must leave, with EXIT_AGENT_LOST
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-watchdog", daemon=True)

    @property
    def active(self) -> bool:
        return self.parent is not None

    def start(self) -> None:
        if self.active:
            self._thread.start()

    def stop(self) -> None:
        """Stop watching; a grace period already running still ends the process if it has not left."""
        self._stop.set()

    def _run(self) -> None:
        assert self.lineage is not None  # started only when active
        while not self._stop.wait(self.interval_s):
            if not lineage_intact(self.lineage):
                self._agent_lost()
                return

    def _agent_lost(self) -> None:
        self.lost = True
        self.stop_request.request("agent_lost")
        with contextlib.suppress(Exception):  # the log cannot raise, but nothing may keep the exit below
            get_logger().error(Event.AGENT_LOST, parent_pid=self.parent, grace_s=self.grace_s)
        # The loop stops after the step in progress and saves; if that (or a collective waiting for a
        # dead peer) takes longer than the grace, leave regardless; a save in flight may still finish (the
        # dead agent sends no SIGKILL that could cut it). os._exit: no cleanup that could block.
        time.sleep(self.grace_s)
        self.stop_request.wait_for_save(self.save_limit_s)
        os._exit(EXIT_AGENT_LOST)
