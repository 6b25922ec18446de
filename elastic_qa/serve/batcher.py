"""Dynamic batching: one model thread answers the questions of many requests in one call.

Request threads `submit` a request's questions and wait for its answers. The model thread takes the oldest
waiting request, then gathers more until it holds `max_batch` questions or `max_wait` has passed since it
took the first, answers them all in one call of `answer` and hands each request its own answers. A request
is never split (one with more than max_batch questions is answered alone). The queue of waiting requests is
bounded: a full queue refuses at once (Busy) rather than let every wait grow. A request that waits longer
than its timeout is given up (TimedOut); the model skips it when it has not started on it yet.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

Pair = tuple[str, str]  # (question, context)
AnswerFn = Callable[[list[Pair]], Sequence[Any]]  # one answer per pair, in order


class Busy(Exception):
    """The queue of waiting requests is full."""


class TimedOut(Exception):
    """A request was not answered within its timeout."""


class Stopped(Exception):
    """The batcher is closed: it takes no more requests."""


@dataclass(eq=False)
class _Request:
    pairs: list[Pair]
    done: threading.Event = field(default_factory=threading.Event)
    answers: Sequence[Any] = ()
    error: BaseException | None = None
    started: bool = False  # the model has taken it: too late to give it up
    abandoned: bool = False  # its client stopped waiting before the model took it


_STOP = _Request([])


@dataclass
class BatchStats:
    """What the model thread has done: for /healthz and the benchmark."""

    batches: int = 0
    questions: int = 0
    largest: int = 0  # the most questions answered in one call


class Batcher:
    """A bounded queue of requests and the one thread that answers them (see the module docstring)."""

    def __init__(self, answer: AnswerFn, max_batch: int, max_wait: timedelta, queue_size: int) -> None:
        if max_batch < 1 or queue_size < 1 or max_wait < timedelta(0):
            raise ValueError(f"max_batch={max_batch}, queue_size={queue_size} (>= 1), max_wait={max_wait}")
        self._answer = answer
        self.max_batch = max_batch
        self._max_wait_s = max_wait.total_seconds()
        self._queue: queue.Queue[_Request] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()  # guards each request's started/abandoned and `_closed`
        self._closed = False
        self.stats = BatchStats()
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)
        self._thread.start()

    def submit(self, pairs: list[Pair], timeout: timedelta) -> Sequence[Any]:
        """The answers to `pairs`, in order; Busy, TimedOut or Stopped, or what `answer` raised for it."""
        request = _Request(pairs)
        with self._lock:
            if self._closed:
                raise Stopped("the server is stopping")
            try:
                self._queue.put_nowait(request)
            except queue.Full:
                raise Busy(f"{self._queue.maxsize} requests are already waiting") from None
        if not request.done.wait(timeout.total_seconds()):
            with self._lock:
                request.abandoned = not request.started
            raise TimedOut(f"not answered within {timeout.total_seconds():g} s")
        if request.error is not None:
            raise request.error
        return request.answers

    def close(self, timeout: timedelta | None = None) -> bool:
        """Answer what is waiting, then stop the model thread; later submits raise Stopped. Whether the
        thread ended within `timeout` (None: as long as it takes): a model call that hangs is left to the
        process's exit (the thread is a daemon) rather than holding the stop forever."""
        with self._lock:
            self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:  # after every waiting request: the model thread drains the queue first
            self._queue.put(_STOP, timeout=left())
        except queue.Full:  # the model thread takes nothing: it is stuck in a call
            return False
        self._thread.join(left())
        return not self._thread.is_alive()

    def _take(self, request: _Request) -> bool:
        """Mark `request` started unless its client gave up on it."""
        with self._lock:
            request.started = not request.abandoned
            return request.started

    def _run(self) -> None:
        carried: _Request | None = None  # taken from the queue but left for the next batch
        while True:
            first = carried if carried is not None else self._queue.get()
            carried = None
            if first is _STOP:
                return
            if not self._take(first):
                continue
            batch, count = [first], len(first.pairs)
            deadline = time.monotonic() + self._max_wait_s
            while count < self.max_batch:
                try:
                    waited = deadline - time.monotonic()
                    following = self._queue.get(timeout=waited) if waited > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is _STOP or count + len(following.pairs) > self.max_batch:
                    carried = following
                    break
                if self._take(following):
                    batch.append(following)
                    count += len(following.pairs)
            self._answer_batch(batch, count)

    def _answer_batch(self, batch: list[_Request], count: int) -> None:
        pairs = [pair for request in batch for pair in request.pairs]
        try:
            answers = self._answer(pairs)
            if len(answers) != len(pairs):
                raise RuntimeError(f"{len(answers)} answers to {len(pairs)} questions")
        except Exception as err:  # noqa: BLE001 - each waiting request gets it; the thread goes on serving
            for request in batch:
                request.error = err
                request.done.set()
            return
        self.stats.batches += 1
        self.stats.questions += count
        self.stats.largest = max(self.stats.largest, count)
        at = 0
        for request in batch:
            request.answers = answers[at : at + len(request.pairs)]
            at += len(request.pairs)
            request.done.set()
