"""When a periodic save is due, and which checkpoints the rotation keeps."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastic_qa.checkpoint.policy import SaveSchedule, retained_steps
from elastic_qa.config import CheckpointConfig


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def due(schedule: SaveSchedule, step: int, failing: bool = False) -> bool:
    """What the trainer asks after each step (the timer is rank 0's, the step triggers everyone's)."""
    return schedule.step_due(step) or schedule.time_due(failing)


def test_a_save_falls_due_once_the_interval_has_passed_since_the_last_one() -> None:
    clock = FakeClock()
    schedule = SaveSchedule(CheckpointConfig(interval=timedelta(minutes=10)), clock=clock)

    assert not due(schedule, 1)
    clock.advance(599)
    assert not due(schedule, 2)
    clock.advance(1)
    assert due(schedule, 3)


def test_saving_restarts_the_interval() -> None:
    clock = FakeClock()
    schedule = SaveSchedule(CheckpointConfig(interval=timedelta(seconds=30)), clock=clock)
    clock.advance(45)
    assert due(schedule, 5)

    schedule.saved()

    assert not due(schedule, 6)
    clock.advance(29.9)
    assert not due(schedule, 7)
    clock.advance(0.1)
    assert due(schedule, 8)


def test_every_steps_makes_each_multiple_due_whatever_the_clock_says() -> None:
    clock = FakeClock()
    schedule = SaveSchedule(CheckpointConfig(interval=timedelta(hours=1), every_steps=50), clock=clock)

    assert [step for step in range(1, 201) if due(schedule, step)] == [50, 100, 150, 200]


def test_each_milestone_step_is_saved_so_that_it_can_be_kept() -> None:
    clock = FakeClock()
    cfg = CheckpointConfig(interval=timedelta(hours=1), every_steps=30, keep_every_steps=100)
    schedule = SaveSchedule(cfg, clock=clock)

    assert [step for step in range(1, 201) if due(schedule, step)] == [30, 60, 90, 100, 120, 150, 180, 200]


def test_every_steps_zero_leaves_only_the_timer() -> None:
    clock = FakeClock()
    schedule = SaveSchedule(CheckpointConfig(interval=timedelta(hours=1), every_steps=0), clock=clock)

    assert not any(due(schedule, step) for step in range(0, 1000))
    clock.advance(3600)
    assert due(schedule, 1001)


def test_the_clock_starts_when_the_schedule_is_created() -> None:
    clock = FakeClock(now=50_000.0)
    schedule = SaveSchedule(CheckpointConfig(interval=timedelta(seconds=10)), clock=clock)
    assert not due(schedule, 1)
    clock.advance(10)
    assert due(schedule, 2)


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "expected"),
    [
        ([10, 20, 30, 40, 50, 60], 3, 0, {40, 50, 60}),
        ([60, 10, 50, 20, 40, 30], 3, 0, {40, 50, 60}),  # order of listing does not matter
        ([10, 20], 3, 0, {10, 20}),
        ([], 3, 0, set()),
        ([7], 1, 0, {7}),
        ([10, 20, 30, 40, 50, 60], 1, 0, {60}),
        ([10, 20, 30, 40, 50, 60], 2, 20, {20, 40, 50, 60}),
        ([100, 150, 200, 250, 300, 350], 2, 100, {100, 200, 300, 350}),
        ([5, 15, 25], 1, 10, {25}),  # no multiples: milestones add nothing
    ],
)
def test_retained_steps_keeps_the_newest_and_the_milestones(steps, keep_last, keep_every, expected) -> None:
    assert retained_steps(steps, keep_last, keep_every) == expected


def test_while_saves_fail_the_timer_retries_sooner_backing_off_to_the_interval() -> None:
    clock = FakeClock()
    schedule = SaveSchedule(CheckpointConfig(interval=timedelta(minutes=30)), clock=clock)
    schedule.saved()  # the save that failed
    clock.advance(4)
    assert not due(schedule, 1, failing=True)
    clock.advance(1)
    assert due(schedule, 2, failing=True)  # 5 s, not 30 minutes, after the failure
    schedule.saved()
    clock.advance(9)
    assert not due(schedule, 3, failing=True)
    clock.advance(1)
    assert due(schedule, 4, failing=True)  # then 10 s
    schedule.saved()
    clock.advance(10)
    assert not due(schedule, 5, failing=False)  # storage is back: the interval again
