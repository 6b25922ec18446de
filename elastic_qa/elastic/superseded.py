"""Stop a worker group that a newer group of the same job has superseded, instead of letting it train on.

torchrun's c10d rendezvous keeps each agent's place alive with heartbeats. On a host slow enough that an
agent's heartbeats come late, a joining agent can take it for dead, complete a round without it and start a
group of its own, while the late agent's group trains on, unaware: two groups of one job at once. Measured
here (the goodput benchmark's four jobs on 2 cores, load 14-16): after a node fault, the store host's agent
trained alone as attempt 11 while the replacement agent trained alone as attempts 12 and 13, for 17
minutes. The fence (checkpoint/fencing.py) kept attempt 11 from committing anything, but the group learned
so only at its next save, half an hour later at the default checkpoint.interval, and trained for nothing
meanwhile.

So rank 0 lists the job's attempt numbers every checkpoint.fence_check_every. Once a newer one is
registered it asks the loop to stop, as a signal would: the group agrees at the next control step, the
stop's save is refused by the fence (`not_saved_stale`: the newer group holds the run), and the worker
exits 75. Its agent then rejoins the rendezvous, where the newer group admits it as a joining node. A
storage error while listing is not a reason to stop: the next check tries again, and saves check anyway.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta

from elastic_qa.elastic.signals import StopRequest
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger


class SupersededWatch:
    """Asks `stop_request` for a stop once `newest()` (the job's newest registered attempt) is past
    `attempt`; checks every `interval` from a thread of its own until `stop`."""

    def __init__(
        self, interval: timedelta, attempt: int, newest: Callable[[], int], stop_request: StopRequest
    ) -> None:
        self.interval_s = interval.total_seconds()
        self.attempt, self.newest, self.stop_request = attempt, newest, stop_request
        self.superseded_by: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="superseded-watch", daemon=True)

    def start(self) -> None:
        if self.interval_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """One look; whether this attempt is superseded (then the stop is asked for, once)."""
        try:
            newest = self.newest()
        except Exception:  # noqa: BLE001 - a listing that failed says nothing: the next one tries again
            return False
        if newest <= self.attempt:
            return False
        self.superseded_by = newest
        with contextlib.suppress(Exception):  # the log cannot raise, but the stop below must happen
            get_logger().error(Event.ATTEMPT_SUPERSEDED, attempt=self.attempt, newest=newest)
        self.stop_request.request("superseded")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.check():
                return
