"""The superseded watch alone (elastic/superseded.py): a newer attempt asks for a stop once; a listing that
fails or shows nothing newer does not. The whole path through a real torchrun job is in
tests/integration/test_superseded.py."""

from __future__ import annotations

import threading
from datetime import timedelta

from elastic_qa.elastic.signals import StopRequest
from elastic_qa.elastic.superseded import SupersededWatch


def test_a_newer_attempt_asks_for_a_stop_and_an_equal_one_or_a_failed_listing_does_not() -> None:
    newest = [3]

    def listing() -> int:
        if newest[0] < 0:
            raise OSError("the store is down")
        return newest[0]

    stop = StopRequest()
    watch = SupersededWatch(timedelta(seconds=10), 3, listing, stop)
    assert not watch.check() and not stop.requested
    newest[0] = -1
    assert not watch.check() and not stop.requested  # a failed listing says nothing
    newest[0] = 4
    assert watch.check() and stop.requested and stop.signal_name == "superseded"
    assert watch.superseded_by == 4


def test_the_thread_stops_the_group_once_a_newer_group_registers() -> None:
    registered = threading.Event()
    listed_after = threading.Event()

    def listing() -> int:
        if registered.is_set():
            listed_after.set()
            return 8
        return 7

    stop = StopRequest()
    watch = SupersededWatch(timedelta(milliseconds=20), 7, listing, stop)
    watch.start()
    try:
        assert not stop.requested
        registered.set()
        assert listed_after.wait(timeout=30)
        watch._thread.join(timeout=30)  # it returns right after the look that found the newer attempt
        assert not watch._thread.is_alive() and stop.requested and watch.superseded_by == 8
    finally:
        watch.stop()


def test_an_interval_of_zero_starts_no_thread() -> None:
    watch = SupersededWatch(timedelta(0), 1, lambda: 2, StopRequest())
    watch.start()
    assert not watch._thread.is_alive()
