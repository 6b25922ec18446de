"""Follow a run's JSON logs as they grow: each call returns only the lines appended since the last."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every JSON log line of a run, in time order (torn lines of a killed writer or full disk skipped)."""
    follower = LogFollower(Path(run_dir) / "logs")
    return sorted(follower.new_events(), key=lambda row: row.get("ts", 0.0))


class LogFollower:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._offsets: dict[Path, int] = {}

    def new_events(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(self.log_dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = offset + complete
            for line in chunk[:complete].splitlines():
                try:
                    row = json.loads(line)
                except ValueError:  # a torn line: not JSON, or cut inside a UTF-8 sequence
                    continue
                if isinstance(row, dict):
                    rows.append(row)
        return rows


class CrashLoopDetector:
    """Sees a worker group that keeps failing the same way without completing a step.

    torchrun restarts a failed group up to --max-restarts times, which is what elasticity needs, but a
    deterministic error (a checkpoint that does not fit the model, a bug at start-up) would then burn every
    restart. Fed with log events, `verdict()` names the error once `attempts` attempts in a row failed
    with it and none trained a step.
    """

    def __init__(self, attempts: int = 3) -> None:
        self.attempts = attempts
        self.errors: dict[int, str] = {}
        self.bad_input: set[int] = set()
        self.trained: set[int] = set()

    def feed(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            attempt = event.get("attempt")
            if attempt is None:
                continue
            if event.get("event") == "step":
                self.trained.add(attempt)
            elif event.get("event") in ("worker_crash", "bad_input"):
                self.errors.setdefault(attempt, event.get("error", "?"))
                if event["event"] == "bad_input":
                    self.bad_input.add(attempt)

    def verdict(self) -> tuple[str, bool] | None:
        """(the error, whether it is bad input) once the job is in a crash loop, else None."""
        if len(self.errors) < self.attempts:
            return None
        newest = sorted(self.errors)[-self.attempts :]
        messages = {self.errors[a] for a in newest}
        if len(messages) == 1 and not self.trained.intersection(range(newest[0], newest[-1] + 1)):
            return messages.pop(), newest[-1] in self.bad_input
        return None
