"""One tracker behind a bounded queue and a thread of its own: the training step never waits on it.

The training thread only enqueues (`log`, `close`); the tracker's thread opens the run, sends what is queued
and closes it. The tracker is dropped, with one `tracker_dropped` warning, and training goes on without it,
when:
    a call raises (the server refuses, the disk is full, the library has a bug)
    a call has been running for longer than log.tracker_timeout (a hung network call: the thread is left
        behind, a daemon, and whatever it returns later is ignored)
    the queue is full: the tracker fell QUEUE_CALLS calls behind
    the last flush at close has not finished within log.tracker_timeout

Exactly once across restarts: `TrackerRun.open` continues the run a restarted job belongs to and returns
the highest step it already holds per metric; the thread skips every value at or below it. A job rolled back
to checkpoint step S re-trains S+1..K, which a crashed attempt may have logged: those are skipped, the steps
it had not logged (still queued when it died) are logged now. Steps are logged in order, so what the run
holds is always a prefix of the series: the high-water mark says exactly which steps it has.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from elastic_qa.config import Config
from elastic_qa.observe.log import get_logger

# How far a tracker may fall behind before it is dropped. 1,000 calls are 100 s of steps at 10 steps/s with
# log.every_steps=1; a tracker that far behind is not keeping up and will not catch up while training runs.
QUEUE_CALLS = 1000

Record = tuple[int, dict[str, float]]  # (step, {metric: value})
_T = TypeVar("_T")


class TrackerRun(Protocol):
    """One run of one tracker (MLflow, W&B). Called from the tracker's own thread only."""

    name: str
    # Records the run may have taken but not stored yet: 0 when `log` returns once they are stored (MLflow);
    # W&B hands them to a process of its own, which writes them a little later.
    pending_records: int

    def open(self) -> dict[str, int]:
        """Start the run, or continue the one this job already has; the highest step it holds per metric."""
        ...

    def log(self, records: list[Record]) -> None:
        """Send these values, in step order."""
        ...

    def close(self, finished: bool) -> None:
        """End the run: finished (the job is done) or interrupted (it may be resumed)."""
        ...


class BackgroundTracker:
    def __init__(
        self,
        run: TrackerRun,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        send_every_s: float = 0.0,
    ) -> None:
        self.run, self.timeout_s, self.clock = run, timeout_s, clock
        self.send_every_s = send_every_s
        self.name = run.name
        self.dropped: str | None = None  # why, once dropped
        self.high_water: dict[str, int] = {}
        self.skipped = 0  # values not sent because the run already held their step
        self.processed = 0  # records sent, or skipped as already held, in the order they were logged
        self._queue: queue.Queue[Record | bool] = queue.Queue(maxsize=QUEUE_CALLS)
        self._busy_since: float | None = None  # when the call now running started
        self._closed = threading.Event()  # the run was closed
        self._stopped = threading.Event()  # the tracker's thread has ended: closed, or on an error
        self._closing = threading.Event()  # close was asked for: send what is queued now
        self._drop_lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=f"tracker-{self.name}", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Enqueue; never blocks (a tracker behind or hung is dropped instead)."""
        if self._alive():
            try:
                self._queue.put_nowait((step, metrics))
            except queue.Full:
                self._drop(f"it fell {QUEUE_CALLS} calls behind")

    def close(self, finished: bool) -> None:
        """Flush what is queued and end the run, waiting at most log.tracker_timeout."""
        self.start_closing(finished)
        self.wait_closed(self.clock() + self.timeout_s)

    def start_closing(self, finished: bool) -> None:
        if self._alive():
            try:
                self._queue.put_nowait(finished)
            except queue.Full:
                self._drop(f"it fell {QUEUE_CALLS} calls behind")
            self._closing.set()

    def wait_closed(self, deadline: float) -> None:
        """Wait until the run is closed, or drop the tracker at `deadline` (on self.clock)."""
        if self.dropped is None and not self._stopped.wait(max(0.0, deadline - self.clock())):
            self._drop(f"its last flush took longer than {self.timeout_s:g} s")

    @property
    def confirmed(self) -> int:
        """How many records, in the order they were logged, the run holds for certain."""
        if self._closed.is_set():
            return self.processed
        return max(0, self.processed - self.run.pending_records)

    def _alive(self) -> bool:
        if self.dropped is not None or self._closed.is_set():
            return False
        started = self._busy_since
        if started is not None and self.clock() - started > self.timeout_s:
            self._drop(f"a call has been running for longer than {self.timeout_s:g} s")
            return False
        return True

    def _drop(self, reason: str) -> None:
        with self._drop_lock:
            if self.dropped is not None:
                return
            self.dropped = reason
        get_logger().warning(
            "tracker_dropped", tracker=self.name, reason=reason, note="training goes on without it"
        )

    # ---- the tracker's thread -----------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self.high_water = self._call(self.run.open)
            while self.dropped is None:
                item = self._queue.get()
                records: list[Record] = []
                while not isinstance(item, bool):
                    records.append(item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                fresh = self._unsent(records)
                if fresh and self.dropped is None:
                    self._call(functools.partial(self.run.log, fresh))
                self.processed += len(records)
                if isinstance(item, bool) and self.dropped is None:
                    self._call(functools.partial(self.run.close, item))
                    self._closed.set()
                    return
                # Gather the next batch meanwhile: a call costs rank 0 CPU however few values it carries.
                self._closing.wait(self.send_every_s)
        except Exception as err:  # noqa: BLE001 - any failure of a tracker only drops it
            self._drop(f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
        finally:
            self._stopped.set()

    def _call(self, call: Callable[[], _T]) -> _T:
        self._busy_since = self.clock()
        try:
            return call()
        finally:
            self._busy_since = None

    def _unsent(self, records: list[Record]) -> list[Record]:
        """The values of `records` above the run's high-water mark of their metric, which then moves up."""
        fresh = []
        for step, metrics in records:
            new = {key: value for key, value in metrics.items() if step > self.high_water.get(key, 0)}
            self.skipped += len(metrics) - len(new)
            if new:
                fresh.append((step, new))
                self.high_water.update(dict.fromkeys(new, step))
        return fresh


def tracker_run_name(cfg: Config) -> str:
    """The run's name in a tracker: log.tracker_run_name, else the run directory's name."""
    return cfg.log.tracker_run_name or Path(cfg.run.dir).resolve().name
