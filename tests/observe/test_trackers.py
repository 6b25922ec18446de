"""Trackers behind their own thread: they skip the steps their run already holds, and one that raises, hangs
or falls behind is dropped with one warning while logging never blocks. The real MLflow and W&B runs across
kills and restarts are in test_tracker_runs.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from structlog.testing import capture_logs

from elastic_qa.config import ConfigError, resolve_config
from elastic_qa.observe.trackers import STANDBY_RECORDS, Trackers
from elastic_qa.observe.trackers.background import QUEUE_CALLS, BackgroundTracker, Record
from elastic_qa.train_state import ResumeError, metrics_backlog

TIMEOUT_S = 60.0


class Recorded:
    """A tracker run that keeps what it is given; it holds `held` (metric: highest step) from the start.
    Each call waits for `gate` first, so that a test decides when the tracker gets to it."""

    name = "recorded"
    pending_records = 0

    def __init__(self, held: dict[str, int] | None = None) -> None:
        self.held = held or {}
        self.sent: list[Record] = []
        self.finished: bool | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a call is waiting at the gate

    def open(self) -> dict[str, int]:
        self._pass_gate()
        return dict(self.held)

    def log(self, records: list[Record]) -> None:
        self._pass_gate()
        self.sent.extend(records)

    def close(self, finished: bool) -> None:
        self.finished = finished

    def _pass_gate(self) -> None:
        self.waiting.set()
        self.gate.wait()


class Failing(Recorded):
    name = "failing"

    def log(self, records: list[Record]) -> None:
        raise OSError("the tracking server refused the batch")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dropped_warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "tracker_dropped"]


def steps_of(sent: list[Record], metric: str) -> list[int]:
    return [step for step, values in sent if metric in values]


def test_steps_the_run_already_holds_are_skipped_metric_by_metric() -> None:
    run = Recorded(held={"loss": 5, "eval_f1": 4})
    tracker = BackgroundTracker(run, TIMEOUT_S)
    for step in range(1, 9):
        tracker.log(step, {"loss": 1.0 / step})
        if step % 2 == 0:
            tracker.log(step, {"eval_f1": 0.5})
    tracker.close(finished=True)
    assert steps_of(run.sent, "loss") == [6, 7, 8]
    assert steps_of(run.sent, "eval_f1") == [6, 8]
    assert tracker.skipped == 5 + 2 and tracker.processed == 12
    assert run.finished is True and tracker.dropped is None


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_takes_no_more_calls() -> None:
    run = Failing()
    with capture_logs() as logs:
        tracker = BackgroundTracker(run, TIMEOUT_S)
        tracker.log(1, {"loss": 1.0})
        tracker.close(finished=True)  # returns once the tracker's thread has ended on the error
        tracker.log(2, {"loss": 0.5})
        tracker.close(finished=True)
    assert tracker.dropped == "OSError: the tracking server refused the batch"
    assert [entry["tracker"] for entry in dropped_warnings(logs)] == ["failing"]
    assert run.finished is None


def test_a_hung_call_drops_the_tracker_once_it_outlasts_the_timeout_and_logging_never_waits() -> None:
    run, clock = Recorded(), Clock()
    run.gate.clear()
    with capture_logs() as logs:
        tracker = BackgroundTracker(run, TIMEOUT_S, clock=clock)
        assert run.waiting.wait(TIMEOUT_S)  # the tracker's thread is stuck opening its run
        tracker.log(1, {"loss": 1.0})
        assert tracker.dropped is None
        clock.now += TIMEOUT_S + 1
        tracker.log(2, {"loss": 0.5})  # sees the hung call: drops the tracker instead of queueing
        tracker.close(finished=True)  # a dropped tracker is not waited for
    assert tracker.dropped is not None and "longer than 60 s" in tracker.dropped
    assert len(dropped_warnings(logs)) == 1
    run.gate.set()  # the hung call returns at last: nothing more is sent
    assert run.sent == [] and run.finished is None


def test_a_flush_that_outlasts_the_timeout_at_close_drops_the_tracker() -> None:
    run, clock = Recorded(), Clock()
    run.gate.clear()
    with capture_logs() as logs:
        tracker = BackgroundTracker(run, TIMEOUT_S, clock=clock)
        tracker.log(1, {"loss": 1.0})
        tracker.start_closing(finished=True)
        tracker.wait_closed(deadline=clock.now)  # the deadline has come: no waiting
    assert tracker.dropped is not None and "last flush" in tracker.dropped
    assert len(dropped_warnings(logs)) == 1
    run.gate.set()


def test_a_tracker_that_falls_too_far_behind_is_dropped() -> None:
    run = Recorded()
    run.gate.clear()
    with capture_logs() as logs:
        tracker = BackgroundTracker(run, TIMEOUT_S)
        for step in range(1, QUEUE_CALLS + 2):
            tracker.log(step, {"loss": 1.0})
    assert tracker.dropped == f"it fell {QUEUE_CALLS} calls behind"
    assert len(dropped_warnings(logs)) == 1
    run.gate.set()


def test_a_checkpoint_keeps_the_records_a_tracker_does_not_hold_for_certain() -> None:
    stored, handed_on = Recorded(), Recorded()
    handed_on.pending_records = 2  # like W&B: a record is held once two newer ones followed it
    stored.gate.clear()  # still opening its run: holds nothing
    trackers = Trackers([BackgroundTracker(run, TIMEOUT_S) for run in (stored, handed_on)])
    for step in (1, 2, 3, 4):
        trackers.log(step, loss=float(step))
    assert [step for step, _ in trackers.backlog()] == [1, 2, 3, 4]
    stored.gate.set()
    trackers.close(finished=False)
    assert trackers.backlog() == []  # closing the runs stored everything
    assert [step for step, _ in stored.sent] == [step for step, _ in handed_on.sent] == [1, 2, 3, 4]


def test_a_rank_other_than_0_keeps_the_newest_records_for_an_emergency_checkpoint() -> None:
    standby = Trackers([], standby=True)
    for step in range(1, STANDBY_RECORDS + 6):
        standby.log(step, loss=1.0)
    backlog = standby.backlog()
    assert [step for step, _ in backlog] == list(range(6, STANDBY_RECORDS + 6))
    assert [step for step, _ in standby.backlog()] == list(range(6, STANDBY_RECORDS + 6))


def test_a_record_handed_on_is_confirmed_only_once_enough_newer_ones_followed_it() -> None:
    run = Recorded()
    run.pending_records = 2
    tracker = BackgroundTracker(run, TIMEOUT_S)
    tracker.processed = 5  # as the tracker's thread counts them
    assert tracker.confirmed == 3
    tracker.close(finished=True)
    assert tracker.confirmed == tracker.processed


def test_log_trackers_is_a_list_of_known_names_and_log_tensorboard_still_adds_tensorboard() -> None:
    cfg = resolve_config("tiny", ["log.trackers=[mlflow, wandb]", "log.tensorboard=true"])
    assert cfg.log.tracker_names == ["mlflow", "wandb", "tensorboard"]
    problems = {
        "log.trackers=mlflow": "log.trackers='mlflow': expected a list",
        "log.trackers=[neptune]": "log.trackers[0]='neptune': must be one of tensorboard, mlflow, wandb",
        "log.trackers=[mlflow, mlflow]": "lists one twice",
        "log.tracker_timeout=0s": "log.tracker_timeout='0s': must be > 0",
        "log.wandb.mode=cloud": "log.wandb.mode='cloud': must be one of online, offline",
    }
    for override, message in problems.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            resolve_config("tiny", [override])


def test_a_checkpoint_backlog_that_is_not_a_list_of_step_and_metrics_is_refused() -> None:
    assert metrics_backlog([[3, {"loss": 1}]], "ckpt") == [(3, {"loss": 1.0})]
    with pytest.raises(ResumeError, match="checkpoint ckpt: metrics_backlog"):
        metrics_backlog([["three", {"loss": 1.0}]], "ckpt")
