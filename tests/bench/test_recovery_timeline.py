"""bench recovery's timeline of one kill, read from the run directory's log lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_qa.bench.recovery import new_group_events
from elastic_qa.bench.recovery_timeline import timeline
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import LogFollower

KILLED = 1000.0
OLD, NEW = 101, 202  # the killed group's rank 0, the new group's


def write_run(run_dir: Path, lines: list[dict[str, object]]) -> None:
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "bench-kill.json").write_text(json.dumps({"ts": KILLED}))
    by_pid: dict[object, list[dict[str, object]]] = {}
    for line in lines:
        by_pid.setdefault(line["pid"], []).append(line)
    for pid, rows in by_pid.items():
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (run_dir / "logs" / f"rank-0.host.pid-{pid}.jsonl").write_text(text)


def old_group() -> list[dict[str, object]]:
    return [
        {"event": Event.TRAIN_START, "ts": KILLED - 10, "pid": OLD, "rank": 0, "step": 0},
        {"event": Event.STEP, "ts": KILLED - 0.2, "pid": OLD, "rank": 0, "step": 40, "loss": 1.0},
    ]


def test_the_new_groups_first_step_is_its_own_not_a_line_it_recovered_for_the_killed_group(
    tmp_path: Path,
) -> None:
    """The new rank 0 writes the steps the killed one had in flight (`recovered`), stamped with the time the
    killed group ended them, which can fall just after the kill; the recovery ends at the new group's own
    first step, 5 s after the kill (a CI run once reported 0.00 s from such a line)."""
    write_run(
        tmp_path,
        [
            *old_group(),
            {"event": Event.WORKER_START, "ts": KILLED + 3.0, "pid": NEW, "rank": 0, "backend": "gloo"},
            {"event": Event.TRAIN_START, "ts": KILLED + 4.0, "pid": NEW, "rank": 0, "step": 40},
            {"event": Event.STEP, "ts": KILLED + 0.01, "pid": NEW, "rank": 0, "step": 41, "recovered": True,
             "loss": float("nan")},
            {"event": Event.STEP, "ts": KILLED + 5.0, "pid": NEW, "rank": 0, "step": 42, "loss": 1.0},
        ],
    )  # fmt: skip
    figures = timeline(tmp_path)
    assert figures is not None
    assert figures["first_step_at"] == pytest.approx(5.0)
    assert figures["started"] == pytest.approx(3.0)
    # The figure itself (kill -> first step), read as the benchmark reads it while the job runs: it once
    # reported a node loss recovered in 0.01 s from such a line.
    starts, steps = new_group_events(LogFollower(tmp_path / "logs"), {OLD}, KILLED, 5.0, "the test's run")
    assert [row["step"] for row in steps] == [42] and [row["ts"] for row in starts] == [KILLED + 3.0]


def test_a_kill_the_group_never_recovered_from_has_no_timeline(tmp_path: Path) -> None:
    write_run(
        tmp_path,
        [
            *old_group(),
            {"event": Event.STEP, "ts": KILLED + 0.01, "pid": NEW, "rank": 0, "step": 41, "recovered": True,
             "loss": float("nan")},
        ],
    )  # fmt: skip
    assert timeline(tmp_path) is None
