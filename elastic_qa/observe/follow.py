"""Reading a run's JSON logs, all at once or as they grow: the one log reader of the launcher, the chaos
tooling, the benchmarks and the tests.

Log lines are evidence that may be damaged. While the disk is full (the chaos `log-full` fault) a
worker's log writes fail and are dropped, and a write cut short leaves a torn line that the next write
continues. The reader keeps every line it can parse: a torn line gives its complete tail, a last line
still being written (or cut short by a killed writer) is left until its newline arrives, and lines that
are not JSON objects with an `event` are skipped. A line longer than MAX_LINE is no log line and is
skipped; each line costs at most TORN_TRIES parses (linear in its length, whatever it holds). Log files
are opened without following a symlink, and only regular files are read.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from elastic_qa.observe.events import Event

MAX_LINE = 1 << 20  # bytes: the longest log line kept (a crash's message is cut far shorter)
TORN_TRIES = 16  # starts tried in one line: the whole line, then the first `{"` after its start


def parse_log_line(line: bytes | str) -> dict[str, Any] | None:
    """One JSON log line, or None. A write cut short leaves a torn line that the next write continues:
    the complete line is then the tail that starts at one of its `{"`. Only the first TORN_TRIES are
    tried, so a line costs a bounded number of parses, each linear in its length, however many it holds
    (a line of 20,000 `{"` would otherwise cost 20,000 parses: quadratic)."""
    if len(line) > MAX_LINE:
        return None
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    start = 0
    for _ in range(TORN_TRIES):
        try:
            row = json.loads(text[start:])
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than a log line has
            start = text.find('{"', start + 1)
            if start < 0:
                return None
            continue
        return row if isinstance(row, dict) else None
    return None


def open_regular(path: Path | str, dir_fd: int | None = None) -> int | None:
    """A read-only descriptor of the regular file `path` (relative to `dir_fd` when given), or None when
    it is missing, a symlink (not followed), or no regular file (a FIFO is not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def read_events(run_dir: Path, pattern: str = "*.jsonl") -> list[dict[str, Any]]:
    """Every log event of a run that can be read, in time order: from <run_dir>/logs/, of the files that
    match `pattern` (one per process: rank-<r>.<host>.pid-<pid>.jsonl)."""
    follower = LogFollower(Path(run_dir) / "logs", pattern)
    return sorted(follower.new_events(), key=lambda row: row.get("ts", 0.0))


class LogFollower:
    """Follows the log files of a directory: each call returns only the events appended since the last.

    With `since` (a Unix time: when this launch started) the events dated before it are left out: a run
    directory run again still holds the lines of its earlier runs, a crash loop fixed since among them,
    and those are history, not this job's. An undated line cannot be shown to be old and is kept.
    """

    def __init__(self, log_dir: Path, pattern: str = "*.jsonl", since: float | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.pattern = pattern
        self.since = since
        self._offsets: dict[Path, int] = {}

    def new_events(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(self.log_dir.glob(self.pattern)):
            offset = self._offsets.get(path, 0)
            if (fd := open_regular(path)) is None:
                continue
            with os.fdopen(fd, "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = offset + complete
            for line in chunk[:complete].splitlines():
                row = parse_log_line(line)
                if row is not None and "event" in row and not self._earlier(row):
                    rows.append(row)
        return rows

    def _earlier(self, row: dict[str, Any]) -> bool:
        stamp = row.get("ts")
        return self.since is not None and isinstance(stamp, (int, float)) and stamp < self.since


CRASH_LOOP_ATTEMPTS = 3  # worker processes in a row failing with one error, none training a step


def process_key(event: dict[str, Any]) -> tuple[str, str, Any] | None:
    """Which process wrote `event`: its host and pid (pids repeat across the hosts that share a run
    directory), or its host and attempt for a line without a pid; None when the line says neither."""
    host = str(event.get("node", "")).rsplit("/", 1)[0]  # `host@addr/group_rank`: the group rank may change
    if event.get("pid") is not None:
        return host, "pid", event["pid"]
    if event.get("attempt") is not None:
        return host, "attempt", event["attempt"]
    return None


class CrashLoopDetector:
    """Sees a worker group that keeps failing the same way without completing a step.

    torchrun restarts a failed group up to --max-restarts times, which is what elasticity needs, but a
    deterministic error (a checkpoint that does not fit the model, a bug at start-up) would then burn every
    restart. Fed with log events, `verdict()` names the error once `attempts` worker processes in a row
    failed with it and none of them trained a step. Failures are told apart by process (`process_key`),
    not by attempt number: a start refused as bad input fails before it registers an attempt.
    """

    def __init__(self, attempts: int = CRASH_LOOP_ATTEMPTS) -> None:
        self.attempts = attempts
        self.errors: dict[Any, tuple[float, str]] = {}  # process -> (when, error)
        self.bad_input: set[Any] = set()
        self.trained: set[Any] = set()

    def feed(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            process = process_key(event)
            if process is None:
                continue
            if event.get("event") == Event.STEP:
                self.trained.add(process)
            elif event.get("event") in (Event.WORKER_CRASH, Event.BAD_INPUT) and process not in self.errors:
                self.errors[process] = (event.get("ts", len(self.errors)), event.get("error", "?"))
                if event["event"] == Event.BAD_INPUT:
                    self.bad_input.add(process)

    def verdict(self) -> tuple[str, bool] | None:
        """(the error, whether it is bad input) once the job is in a crash loop, else None."""
        if len(self.errors) < self.attempts:
            return None
        newest = sorted(self.errors, key=lambda process: self.errors[process][0])[-self.attempts :]
        messages = {self.errors[process][1] for process in newest}
        if len(messages) == 1 and not self.trained.intersection(newest):
            return messages.pop(), newest[-1] in self.bad_input
        return None
