"""When to save (timer, step count) and what to keep (the last N, plus milestones)."""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic_qa.config import CheckpointConfig

RETRY_FIRST_S = 5.0  # the first retry after a failed save


class SaveSchedule:
    """Rank 0's view of whether a periodic save is due; the trainer broadcasts its answer to all ranks."""

    def __init__(self, cfg: CheckpointConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = cfg.interval.total_seconds()
        self.every_steps = cfg.every_steps
        self.milestone_steps = cfg.keep_every_steps
        self.clock = clock
        self.last_save = clock()
        self.retry_s = RETRY_FIRST_S

    def step_due(self, step: int) -> bool:
        """The step triggers (every_steps, and milestones: a milestone that is never saved cannot be kept);
        every rank computes them alike, without agreeing."""
        return any(every > 0 and step % every == 0 for every in (self.every_steps, self.milestone_steps))

    def time_due(self, failing: bool = False) -> bool:
        """The timer: only rank 0's answer counts (clocks differ), so it travels to the others.

        While saves fail (storage errors) the next try comes sooner, backing off from 5 s to the interval:
        a short outage then costs one late checkpoint, not a whole interval of unprotected work.
        """
        if not failing:
            self.retry_s = RETRY_FIRST_S
            return self.clock() - self.last_save >= self.interval_s
        if self.clock() - self.last_save < min(self.retry_s, self.interval_s):
            return False
        self.retry_s = min(self.retry_s * 2, self.interval_s)
        return True

    def saved(self) -> None:
        self.last_save = self.clock()


def retained_steps(steps: list[int], keep_last: int, keep_every_steps: int) -> set[int]:
    """Steps to keep: the newest `keep_last`, and every multiple of `keep_every_steps` (milestones)."""
    newest = sorted(steps)[-keep_last:]
    milestones = {s for s in steps if keep_every_steps and s % keep_every_steps == 0}
    return set(newest) | milestones
