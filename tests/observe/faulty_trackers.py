"""A training worker whose rank 0 has, beside the trackers its config names, one tracker that raises at its
first log and one whose first log never returns (dropped after HANG_TIMEOUT_S). Run as
`python -m tests.observe.faulty_trackers --config tiny OVERRIDES...` by test_tracker_runs.py."""

from __future__ import annotations

import sys
import threading
from typing import Any

from elastic_qa.dist import exit_process
from elastic_qa.observe import trackers
from elastic_qa.observe.trackers.background import BackgroundTracker, Record
from elastic_qa.train import main

HANG_TIMEOUT_S = 1.0


class Raising:
    name = "raising"
    pending_records = 0

    def open(self) -> dict[str, int]:
        return {}

    def log(self, records: list[Record]) -> None:
        raise ConnectionError("tracking server unreachable")

    def close(self, finished: bool) -> None:
        pass


class Hanging(Raising):
    name = "hanging"

    def log(self, records: list[Record]) -> None:
        threading.Event().wait()  # a network call that never returns


configured = trackers.Trackers.start


def with_faulty_ones(cfg: Any, run_uuid: str, backlog: list[Record], main: bool) -> trackers.Trackers:
    real = configured(cfg, run_uuid, backlog, main)
    faulty = [BackgroundTracker(Raising(), HANG_TIMEOUT_S), BackgroundTracker(Hanging(), HANG_TIMEOUT_S)]
    return trackers.Trackers([*(real.trackers if real else []), *faulty])


if __name__ == "__main__":
    trackers.Trackers.start = with_faulty_ones  # type: ignore[method-assign]
    exit_process(main(sys.argv[1:]))
