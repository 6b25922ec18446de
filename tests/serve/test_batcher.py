"""The batcher: each request gets its own answers, batches stay within max_batch, a full queue refuses, a
late request is given up, a failing batch fails its requests only, close answers what is waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import pytest

from elastic_qa.serve.batcher import _STOP, Batcher, Busy, Pair, Stopped, TimedOut

LONG = timedelta(seconds=120)  # a wait that only a broken batcher would reach


class Model:
    """Answers a question with its context's words reversed; holds each call until `go` is set; records
    every call's questions."""

    def __init__(self, held: bool = False) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        if not held:
            self.go.set()
        self.calls: list[list[Pair]] = []

    def __call__(self, pairs: list[Pair]) -> Sequence[str]:
        self.calls.append(list(pairs))
        self.entered.set()
        self.go.wait()
        if any(question == "fail" for question, _ in pairs):
            raise RuntimeError("the model failed")
        return [f"{question}:{context[::-1]}" for question, context in pairs]


def submit_in_thread(
    batcher: Batcher, pairs: list[Pair], results: dict[str, object], key: str
) -> threading.Thread:
    def work() -> None:
        try:
            results[key] = batcher.submit(pairs, LONG)
        except Exception as err:  # noqa: BLE001 - handed to the test
            results[key] = err

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_concurrent_requests_each_get_their_own_answers_in_order_within_max_batch() -> None:
    model = Model(held=True)
    batcher = Batcher(model, max_batch=5, max_wait=timedelta(0), queue_size=64)
    results: dict[str, object] = {}
    blocker = submit_in_thread(batcher, [("first", "x")], results, "first")
    model.entered.wait()  # the model is busy: the next requests queue up behind it
    threads = [
        submit_in_thread(batcher, [(f"q{n}-{i}", f"c{n}{i}") for i in range(n % 3 + 1)], results, f"r{n}")
        for n in range(12)
    ]
    while batcher._queue.qsize() < 12:  # every request is queued before the model is let go
        threading.Event().wait(0.01)
    model.go.set()
    for thread in [blocker, *threads]:
        thread.join()
    batcher.close()
    for n in range(12):
        assert results[f"r{n}"] == [f"q{n}-{i}:{f'c{n}{i}'[::-1]}" for i in range(n % 3 + 1)]
    assert all(len(call) <= 5 for call in model.calls)
    assert len(model.calls) < 13  # queued requests were answered together
    assert sum(len(call) for call in model.calls) == 1 + sum(n % 3 + 1 for n in range(12))
    for call in model.calls:  # a request is never split across calls
        questions = [q for q, _ in call]
        for n in range(12):
            mine = [q for q in questions if q.startswith(f"q{n}-")]
            assert mine in ([], [f"q{n}-{i}" for i in range(n % 3 + 1)])


def test_max_batch_1_answers_one_question_per_call() -> None:
    model = Model()
    batcher = Batcher(model, max_batch=1, max_wait=timedelta(milliseconds=50), queue_size=8)
    results: dict[str, object] = {}
    threads = [submit_in_thread(batcher, [(f"q{n}", "ab")], results, str(n)) for n in range(6)]
    for thread in threads:
        thread.join()
    batcher.close()
    assert [len(call) for call in model.calls] == [1] * 6
    assert {results[str(n)][0] for n in range(6)} == {f"q{n}:ba" for n in range(6)}  # type: ignore[index]


def test_a_request_larger_than_max_batch_is_answered_alone() -> None:
    model = Model()
    batcher = Batcher(model, max_batch=2, max_wait=timedelta(0), queue_size=8)
    assert batcher.submit([("a", "1"), ("b", "2"), ("c", "3")], LONG) == ["a:1", "b:2", "c:3"]
    batcher.close()
    assert model.calls == [[("a", "1"), ("b", "2"), ("c", "3")]]


def test_a_full_queue_refuses_at_once_and_serves_again_once_drained() -> None:
    model = Model(held=True)
    batcher = Batcher(model, max_batch=1, max_wait=timedelta(0), queue_size=2)
    results: dict[str, object] = {}
    threads = [submit_in_thread(batcher, [("held", "x")], results, "held")]
    model.entered.wait()  # the model holds one request; two more fill the queue
    threads += [submit_in_thread(batcher, [(f"w{n}", "x")], results, f"w{n}") for n in range(2)]
    while batcher._queue.qsize() < 2:
        threading.Event().wait(0.01)
    with pytest.raises(Busy, match="2 requests are already waiting"):
        batcher.submit([("refused", "x")], LONG)
    model.go.set()
    for thread in threads:
        thread.join()
    assert batcher.submit([("again", "yz")], LONG) == ["again:zy"]
    batcher.close()
    assert results == {"held": ["held:x"], "w0": ["w0:x"], "w1": ["w1:x"]}


def test_a_request_past_its_timeout_is_given_up_and_never_reaches_the_model() -> None:
    model = Model(held=True)
    batcher = Batcher(model, max_batch=4, max_wait=timedelta(0), queue_size=8)
    results: dict[str, object] = {}
    holder = submit_in_thread(batcher, [("held", "x")], results, "held")
    model.entered.wait()
    with pytest.raises(TimedOut, match=r"not answered within 0\.01 s"):
        batcher.submit([("late", "x")], timedelta(milliseconds=10))
    model.go.set()
    holder.join()
    assert batcher.submit([("next", "x")], LONG) == ["next:x"]
    batcher.close()
    assert all(question != "late" for call in model.calls for question, _ in call)


def test_a_failing_batch_fails_its_requests_and_the_model_thread_goes_on() -> None:
    batcher = Batcher(Model(), max_batch=4, max_wait=timedelta(0), queue_size=8)
    with pytest.raises(RuntimeError, match="the model failed"):
        batcher.submit([("fail", "x")], LONG)
    assert batcher.submit([("ok", "xy")], LONG) == ["ok:yx"]
    batcher.close()


def test_close_answers_what_is_waiting_then_refuses() -> None:
    model = Model(held=True)
    batcher = Batcher(model, max_batch=1, max_wait=timedelta(0), queue_size=8)
    results: dict[str, object] = {}
    threads = [submit_in_thread(batcher, [(f"q{n}", "x")], results, str(n)) for n in range(3)]
    model.entered.wait()
    while batcher._queue.qsize() < 2:
        threading.Event().wait(0.01)
    closing = threading.Thread(target=batcher.close)
    closing.start()
    model.go.set()
    closing.join()
    for thread in threads:
        thread.join()
    assert sorted(results.values()) == [["q0:x"], ["q1:x"], ["q2:x"]]  # type: ignore[type-var]
    with pytest.raises(Stopped):
        batcher.submit([("after", "x")], LONG)


@pytest.mark.parametrize("queue_size", [1, 8], ids=["queue full", "queue with room"])
def test_close_with_a_bound_leaves_a_model_call_that_hangs_behind(queue_size: int) -> None:
    """A model call that never returns holds neither the stop (the bound) nor a full queue (the stop
    marker's put is bounded too); the caller is told the thread did not end."""
    model = Model(held=True)
    batcher = Batcher(model, max_batch=1, max_wait=timedelta(0), queue_size=queue_size)
    results: dict[str, object] = {}
    threads = [submit_in_thread(batcher, [("stuck", "x")], results, "stuck")]
    model.entered.wait()
    if queue_size == 1:
        threads.append(submit_in_thread(batcher, [("waiting", "x")], results, "waiting"))
        while batcher._queue.qsize() < 1:
            threading.Event().wait(0.01)
    started = time.monotonic()
    assert batcher.close(timedelta(seconds=0.2)) is False
    assert time.monotonic() - started < LONG.total_seconds()  # bounded: a hang would reach pytest's end
    model.go.set()  # the call returns at last: the thread answers what waited
    if queue_size == 1:  # the stop marker found no room: this test hands it over to end the thread
        batcher._queue.put(_STOP)
    batcher._thread.join(LONG.total_seconds())
    assert not batcher._thread.is_alive()
    for thread in threads:
        thread.join()
    assert results["stuck"] == ["stuck:x"]
