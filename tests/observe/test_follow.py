"""Reading logs (torn lines too) and following them as they grow; telling a crash loop from bad luck."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_qa.observe.follow import CrashLoopDetector, LogFollower, parse_log_line, read_events


def test_follower_returns_only_new_complete_lines(tmp_path: Path) -> None:
    log = tmp_path / "rank-000.pid-1.jsonl"
    log.write_text(json.dumps({"event": "a"}) + "\n" + '{"event": "b"')  # the second line is half-written
    follower = LogFollower(tmp_path)
    assert [e["event"] for e in follower.new_events()] == ["a"]
    with open(log, "a") as handle:
        handle.write("}\n" + json.dumps({"event": "c"}) + "\n")
    assert [e["event"] for e in follower.new_events()] == ["b", "c"]
    assert follower.new_events() == []


def test_a_torn_log_line_gives_the_whole_line_that_follows_it() -> None:
    assert parse_log_line(b'{"event": "st{"event": "step", "step": 3}') == {"event": "step", "step": 3}
    assert parse_log_line(b'{"event": "step", "step"') is None
    assert parse_log_line(b"[1, 2]") is None


def test_a_follower_reads_torn_lines_and_skips_lines_that_are_not_events(tmp_path: Path) -> None:
    log = tmp_path / "rank-000.pid-1.jsonl"
    log.write_text('{"event": "a", "ts": 1}\n{"event": "st{"event": "b", "ts": 2}\n[1]\n{"ts": 3}\n')
    assert [e["event"] for e in LogFollower(tmp_path).new_events()] == ["a", "b"]


def test_read_events_keeps_time_order_across_files_and_reads_only_those_asked_for(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-000.pid-1.jsonl").write_text(json.dumps({"event": "a", "ts": 2.0}) + "\n")
    (logs / "rank-001.pid-2.jsonl").write_text(json.dumps({"event": "b", "ts": 1.0}) + "\n")
    assert [e["event"] for e in read_events(tmp_path)] == ["b", "a"]
    assert [e["event"] for e in read_events(tmp_path, "rank-000.*")] == ["a"]


def crash(attempt: int, error: str = "ValueError: boom", kind: str = "worker_crash") -> dict:
    return {"event": kind, "attempt": attempt, "error": error}


def test_the_same_error_in_three_attempts_without_training_is_a_crash_loop() -> None:
    detector = CrashLoopDetector(attempts=3)
    detector.feed([crash(1), crash(2)])
    assert detector.verdict() is None
    detector.feed([crash(3, kind="bad_input")])
    assert detector.verdict() == ("ValueError: boom", True)


def test_starts_refused_before_registering_an_attempt_are_told_apart_by_process() -> None:
    """A start refused as bad input fails before it registers an attempt: every failure says attempt 0."""
    detector = CrashLoopDetector(attempts=3)
    for pid, ts in ((101, 1.0), (102, 2.0)):
        detector.feed([{"event": "bad_input", "attempt": 0, "pid": pid, "ts": ts, "error": "does not fit"}])
    assert detector.verdict() is None
    detector.feed([{"event": "bad_input", "attempt": 0, "pid": 103, "ts": 3.0, "error": "does not fit"}])
    assert detector.verdict() == ("does not fit", True)


def test_training_in_between_or_different_errors_is_not_a_crash_loop() -> None:
    trained = CrashLoopDetector(attempts=3)
    trained.feed([crash(1), crash(2), {"event": "step", "attempt": 2, "step": 5}, crash(3)])
    assert trained.verdict() is None
    different = CrashLoopDetector(attempts=3)
    different.feed([crash(1), crash(2, "RuntimeError: peer"), crash(3)])
    assert different.verdict() is None


def test_a_follower_since_a_start_leaves_out_the_lines_logged_before_it(tmp_path: Path) -> None:
    log = tmp_path / "rank-000.pid-1.jsonl"
    rows = [{"event": "old", "ts": 9.5}, {"event": "new", "ts": 10.0}, {"event": "undated"}]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [e["event"] for e in LogFollower(tmp_path, since=10.0).new_events()] == ["new", "undated"]
    assert len(LogFollower(tmp_path).new_events()) == 3


def write_host_logs(logs: Path, host: str, lines: list[dict]) -> None:
    """Each line in the file its process would write: rank-000.<host>.pid-<pid>.jsonl."""
    for line in lines:
        row = {"rank": 0, "node": f"{host}/0", **line}
        path = logs / f"rank-000.{host}.pid-{line['pid']}.jsonl"
        with open(path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def test_processes_of_two_hosts_with_equal_pids_are_told_apart(tmp_path: Path) -> None:
    """Hosts sharing a run directory on shared storage reuse each other's pids."""
    a, b = "trainer-a@10.0.0.1", "trainer-b@10.0.0.2"
    fail = {"event": "worker_crash", "error": "ValueError: boom"}
    missed, masked = tmp_path / "missed", tmp_path / "masked"
    missed.mkdir()
    masked.mkdir()
    # Three processes fail alike, two of them with pid 7: by pid alone that is two failures.
    write_host_logs(missed, a, [{**fail, "pid": 7, "ts": 1.0}, {**fail, "pid": 8, "ts": 3.0}])
    write_host_logs(missed, b, [{**fail, "pid": 7, "ts": 2.0}])
    # Host a's pid 5 trained; host b's pid 5 is one of three processes that never did.
    write_host_logs(masked, a, [{"event": "step", "step": 1, "pid": 5, "ts": 0.5}])
    write_host_logs(masked, b, [{**fail, "pid": pid, "ts": float(pid)} for pid in (5, 6, 7)])

    for logs in (missed, masked):
        detector = CrashLoopDetector(attempts=3)
        detector.feed(LogFollower(logs).new_events())
        assert detector.verdict() == ("ValueError: boom", False), logs.name
