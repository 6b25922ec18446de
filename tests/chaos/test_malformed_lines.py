"""A hand-edited or hostile log line (a field of another type) is passed over by chaos's readers of the run's
events, as observe/events.py's records say, instead of raising out of the verdict."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_qa.chaos.evidence import attempts
from elastic_qa.chaos.faults import registered_attempt

START = {"event": "worker_start", "ts": 1.0, "attempt": 1, "world_size": 2, "rank": 0, "pid": 7}


def test_attempts_pass_over_a_step_line_whose_step_is_no_number() -> None:
    events = [
        START,
        {"event": "step", "ts": 2.0, "attempt": 1, "rank": 0, "step": 5, "loss": 0.5},
        {"event": "step", "ts": 3.0, "attempt": 1, "rank": 0, "step": "6", "loss": 0.5},  # wrong type
        {"event": "resume", "ts": 1.5, "attempt": 1, "rank": 0, "step": [4]},  # wrong type
    ]
    [row] = attempts(events)
    assert row["world_size"] == 2 and row["first_step_ts"] == 2.0
    assert row["last_step"] == 5 and row["resumed_step"] == 0


def test_a_step_line_without_its_figures_still_counts_as_progress() -> None:
    """Readers of a step's number only read through StepProgressRecord: lr and samples_per_s may be absent."""
    [row] = attempts([START, {"event": "step", "ts": 2.0, "attempt": 1, "rank": 0, "step": 3}])
    assert row["last_step"] == 3


def test_registered_attempt_passes_over_a_worker_start_whose_attempt_is_no_number(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [{**START, "attempt": "one"}, {**START, "ts": 1.5, "attempt": 2}]
    (logs / "rank-000.h.pid-7.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert registered_attempt(tmp_path, 7) == 2
