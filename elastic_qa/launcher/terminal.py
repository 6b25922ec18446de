"""What the launcher's terminal shows while it waits for a job: the job's progress and sentences, drawn
from the run's log events (workers never see the terminal), and the crash-loop watch on the same events.

The launcher's own JSON records go to <run.dir>/agents/launch.jsonl only.
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_qa.observe.console import ProgressView
from elastic_qa.observe.follow import CrashLoopDetector, LogFollower

POLL_S = 0.5  # how often the logs are read: the progress shown is at most this old
# How the launcher is named in the commands it suggests: launch/local.sh exports what the user typed.
PROG_ENV = "ELASTIC_QA_PROG"
DEFAULT_PROG = "python -m elastic_qa.launcher.local"


class JobMonitor:
    """Follows <run.dir>/logs from `since` (a Unix time: events of earlier runs are history, see
    LogFollower) and feeds the progress view and the crash-loop detector. `on_crash_loop(error,
    bad_input)` is called once."""

    def __init__(
        self,
        run_dir: Path,
        since: float,
        view: ProgressView,
        on_crash_loop: Callable[[str, bool], None],
    ) -> None:
        self.follower = LogFollower(run_dir / "logs", since=since)
        self.view = view
        self.detector = CrashLoopDetector()
        self.on_crash_loop = on_crash_loop
        self.crash: tuple[str, bool] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop following, after reading what the job wrote last."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()
        self.view.close()

    def poll(self) -> None:
        events = self.follower.new_events()
        events.sort(key=lambda row: row.get("ts", 0.0))
        self.view.feed(events)
        if self.crash is None:
            self.detector.feed(events)
            verdict = self.detector.verdict()
            if verdict:
                self.crash = verdict
                self.on_crash_loop(*verdict)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()


def newest_saved_step(checkpoint_dir: str) -> int | None:
    """The step of the newest committed checkpoint, or None (none, or the store cannot be read)."""
    # Here, not at the top: it imports torch, which `join`, `leave` and `stop` should not wait for.
    from elastic_qa.checkpoint.backends import open_store

    try:
        steps = open_store(checkpoint_dir).list_steps()
    except (OSError, ValueError):
        return None
    return steps[-1].step if steps else None


def resume_command(prog: str, argv: list[str]) -> str:
    """The command that resumes this job: the same launcher and arguments (checkpoint.resume=true picks
    up the newest valid checkpoint of the run directory)."""
    return " ".join([prog, shlex.join(argv)])


def stop_sentence(reason: str, saved: int | None, resume: str) -> str:
    saved_text = f"saved step {saved}" if saved is not None else "no step was saved yet"
    return f"{reason}: {saved_text}; resume with: {resume}"


def wait_quietly(condition: Callable[[], Any], every_s: float = 0.5) -> None:
    while condition():
        time.sleep(every_s)
