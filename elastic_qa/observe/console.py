"""What a person sees: rank 0's progress, drawn in place on a terminal, as plain lines otherwise.

Two owners of the terminal, one look:
    Console       a worker run as one process (`python -m elastic_qa.train`) prints its own progress
    ProgressView  the launcher draws the job's progress from the event stream of the run's logs (workers
                  under the launcher write to their agent's log file and never see the terminal)

Output is a courtesy, never a reason to stop: a terminal that went away (EIO after the SSH session
closed) or a pipe whose reader quit (EPIPE, e.g. `train | head`) would otherwise raise out of the step
logging and end the run without a save. Such writes are dropped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO, TypeVar

from elastic_qa.metrics import em_f1_text
from elastic_qa.observe.events import (
    AttemptStartRecord,
    CheckpointCommittedRecord,
    EmergencyCheckpointRecord,
    EvalRecord,
    Event,
    ResumeRecord,
    StepProgressRecord,
    StoppingRecord,
    TrainDoneRecord,
    TrainStartRecord,
    conforms,
    event_of,
    record,
)

# Set by the launcher for its workers: the launcher owns the terminal, a worker's output goes to a log file.
UNDER_LAUNCHER = "ELASTIC_QA_UNDER_LAUNCHER"
BAR_WIDTH = 24
PLAIN_EVERY_S = 10.0  # plain (non-terminal) output: at most one progress line this often


def format_eta(seconds: float | None) -> str:
    """`1h05m`, `3m20s`, `42s`; `--` while unknown (no rate measured yet)."""
    if seconds is None or seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "--"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_text(step: int, total: int, loss: float, samples_per_s: float, eta: float | None) -> str:
    rate = f"{samples_per_s:,.0f}" if samples_per_s > 0 else "--"
    return f"step {step}/{total}  loss {loss:.4f}  {rate} samples/s  eta {format_eta(eta)}"


def bar(step: int, total: int) -> str:
    filled = min(BAR_WIDTH, int(BAR_WIDTH * step / max(total, 1)))
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]"


class Console:
    """A single worker's own progress (rank 0): a bar on a terminal, plain lines otherwise."""

    def __init__(self, mode: str, total_steps: int, enabled: bool, stream: TextIO = sys.stdout) -> None:
        self.enabled = enabled and mode != "none"
        self.stream = stream
        # Under the launcher stdout is the agent's log file: a bar there is one line of carriage returns.
        under_launcher = bool(os.environ.get(UNDER_LAUNCHER))
        self.bar = not under_launcher and (mode == "progress" or (mode == "auto" and _isatty(stream)))
        self.total = total_steps
        self.started = time.monotonic()
        self.first_step: int | None = None

    def progress(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.started = step, time.monotonic()
        done = step - self.first_step
        rate = done / max(time.monotonic() - self.started, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else None
        text = progress_text(step, self.total, loss, samples_per_s, eta)
        if self.bar:
            self._write(f"\r{bar(step, self.total)} {text}\033[K")
        else:
            self._write(text + "\n")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        self._write(("\r\033[K" if self.bar else "") + text + "\n")

    def _write(self, text: str) -> None:
        print_safely(text, self.stream, end="")


R = TypeVar("R")


def typed(kind: type[R], handler: Callable[[R], None]) -> Callable[[Mapping[str, Any]], None]:
    """A handler of lines: `handler` with the line as the record `kind`, nothing for a line that is none."""

    def handle(row: Mapping[str, Any]) -> None:
        if (rec := record(row, kind)) is not None:
            handler(rec)

    return handle


def untyped(handler: Callable[[Mapping[str, Any]], None]) -> Callable[[Mapping[str, Any]], None]:
    """A handler of the lines of an event without a record: `handler` once the line conforms."""

    def handle(row: Mapping[str, Any]) -> None:
        if conforms(row):
            handler(row)

    return handle


class ProgressView:
    """The job's progress for the launcher's terminal, fed with the run's log events (any rank, any order
    within a batch). Shows rank 0's steps, loss, samples/s, ETA, world size and restarts (in place on a
    terminal, a plain line every PLAIN_EVERY_S otherwise) and one sentence for each thing worth knowing:
    a resume, a regroup, a config change, an evaluation, a diagnosis (again only when it changes), a stop.
    """

    def __init__(
        self,
        mode: str,
        stream: TextIO = sys.stdout,
        clock: Callable[[], float] = time.monotonic,
        plain_every_s: float = PLAIN_EVERY_S,
    ) -> None:
        self.stream = stream
        self.enabled = mode != "none"
        self.in_place = mode == "progress" or (mode == "auto" and _isatty(stream))
        self.clock, self.plain_every_s = clock, plain_every_s
        self.total = 0
        self.step = 0
        self.loss: float | None = None
        self.samples_per_s = 0.0
        self.world_size = 0
        self.restarts = -1  # worker_start of rank 0 seen, minus one
        self.saved_step: int | None = None  # newest checkpoint committed while we watched
        self.done = False
        self.stopping = False  # the launcher stops the job and said so: the workers' stop is no news
        self._rate_origin: tuple[float, int] | None = None  # (ts, step) of this group's first step event
        self._eta: float | None = None
        self._drawn = False  # a bar is on the screen, without its newline
        self._last_plain: float | None = None
        self._said: set[Any] = set()
        # Each handler takes the line as its event's typed record (`typed`: passed over when it is none);
        # those of the events without a record read its fields with .get(), once the line conforms.
        self._handlers: dict[Event, Callable[[Mapping[str, Any]], None]] = {
            Event.WORKER_START: typed(AttemptStartRecord, self._on_worker_start),
            Event.TRAIN_START: typed(TrainStartRecord, self._on_train_start),
            Event.RESUME: typed(ResumeRecord, self._on_resume),
            Event.START_FRESH: untyped(self._on_start_fresh),
            Event.CONFIG_CHANGED: untyped(self._on_config_changed),
            Event.STEP: typed(StepProgressRecord, self._on_step),
            Event.EVAL: typed(EvalRecord, self._on_eval),
            Event.DIAGNOSIS: untyped(self._on_diagnosis),
            Event.STOPPING: typed(StoppingRecord, self._on_stopping),
            Event.EMERGENCY_CHECKPOINT: typed(EmergencyCheckpointRecord, self._on_emergency_checkpoint),
            Event.CHECKPOINT_COMMITTED: typed(CheckpointCommittedRecord, self._on_checkpoint_committed),
            Event.TRAIN_DONE: typed(TrainDoneRecord, self._on_train_done),
        }

    # ---- events -------------------------------------------------------------------------------------
    def feed(self, events: list[dict[str, Any]]) -> None:
        """Take in the workers' events; a line whose fields are not of their types is passed over."""
        for event in events:
            kind = event_of(event)
            handler = self._handlers.get(kind) if kind is not None else None
            if handler is not None:
                handler(event)

    def _on_worker_start(self, event: AttemptStartRecord) -> None:
        if event.get("rank") != 0:
            return
        self.restarts += 1
        self.world_size = int(event.get("world_size", 0))
        self._rate_origin, self._eta = None, None  # a new group: its rate is measured afresh

    def _on_train_start(self, event: TrainStartRecord) -> None:
        if event.get("rank") == 0:
            self.total = event["max_steps"]

    def _on_resume(self, event: ResumeRecord) -> None:
        if event.get("rank") != 0:
            return
        if self.restarts <= 0:
            saved = event.get("saved_world_size")
            self.say(f"resuming from step {event.get('step')} (saved by world size {saved})")
        else:
            self._regrouped(f"resuming from step {event.get('step')}")

    def _on_start_fresh(self, event: Mapping[str, Any]) -> None:
        if event.get("rank") == 0 and self.restarts > 0:
            self._regrouped("starting from step 0 (nothing was saved yet)")

    def _regrouped(self, where: str) -> None:
        self.say(f"regrouped: world size {self.world_size} (restart {self.restarts}), {where}")

    def _on_config_changed(self, event: Mapping[str, Any]) -> None:
        for change in event.get("changes", []):
            key = ("config", change.get("key"), repr(change.get("old")), repr(change.get("new")))
            if key not in self._said:
                self._said.add(key)
                self.say(
                    f"config changed since the checkpoint: {change.get('key')} "
                    f"{change.get('old')!r} -> {change.get('new')!r}: {change.get('effect')}"
                )

    def _on_step(self, event: StepProgressRecord) -> None:
        if event.get("rank") != 0:
            return
        ts, step = float(event.get("ts", self.clock())), int(event["step"])
        self.step, self.loss = step, float(event.get("loss", 0.0))
        self.samples_per_s = float(event.get("samples_per_s", 0.0))
        self.world_size = int(event.get("world_size", self.world_size))
        if self._rate_origin is None:
            self._rate_origin = (ts, step)
        else:
            origin_ts, origin_step = self._rate_origin
            if step > origin_step and ts > origin_ts and self.total:
                self._eta = (self.total - step) * (ts - origin_ts) / (step - origin_step)
        self.draw()

    def _on_eval(self, event: EvalRecord) -> None:
        if event.get("rank") == 0 and "em" in event and "f1" in event:  # a line of its loss only: no news
            self.say(f"eval at step {event['step']}: {em_f1_text(float(event['em']), float(event['f1']))}")

    def _on_diagnosis(self, event: Mapping[str, Any]) -> None:
        finding = str(event.get("finding", ""))
        key = ("diagnosis", finding.split(":")[0])
        if key not in self._said:  # the figures move every window: a new kind of finding is the news
            self._said.add(key)
            self.say(f"diagnosis at step {event.get('step')}: {finding}")

    def _on_stopping(self, event: StoppingRecord) -> None:
        if event.get("rank") == 0 and not self.stopping and ("stopping", event.get("step")) not in self._said:
            self._said.add(("stopping", event.get("step")))
            self.say(f"stopping after step {event.get('step')} ({event.get('signal')}): saving")

    def _on_emergency_checkpoint(self, event: EmergencyCheckpointRecord) -> None:
        key = ("emergency", event.get("attempt"))
        if key not in self._said:
            self._said.add(key)
            self.say(f"a rank failed after step {event.get('step')}: saving, then the agents regroup")

    def _on_checkpoint_committed(self, event: CheckpointCommittedRecord) -> None:
        self.saved_step = max(event["step"], self.saved_step or 0)

    def _on_train_done(self, event: TrainDoneRecord) -> None:
        if event.get("rank") == 0:
            self.done = True
            self.draw(final=True)

    # ---- drawing ------------------------------------------------------------------------------------
    def status(self) -> str:
        loss = self.loss if self.loss is not None else float("nan")
        text = progress_text(self.step, self.total, loss, self.samples_per_s, 0.0 if self.done else self._eta)
        return f"{text}  world {self.world_size}  restarts {max(self.restarts, 0)}"

    def draw(self, final: bool = False) -> None:
        if not self.enabled or self.loss is None:
            return
        if self.in_place:
            self._write(f"\r{bar(self.step, self.total)} {self.status()}\033[K")
            self._drawn = True
            return
        now = self.clock()
        if final or self._last_plain is None or now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            self._write(self.status() + "\n")

    def say(self, text: str, always: bool = False) -> None:
        """One sentence on a line of its own; the bar, if any, is drawn again below it. `always`: said
        even with log.console=none (the launcher's own sentences: started, stopping, the result)."""
        if not (self.enabled or always):
            return
        if self.in_place and self._drawn:
            self._write(f"\r\033[K{text}\n")
            self._drawn = False
            self.draw()
        else:
            self._write(text + "\n")

    def close(self) -> None:
        """End the bar's line, so that what is printed next starts on a line of its own."""
        if self._drawn:
            self._write("\n")
            self._drawn = False

    def _write(self, text: str) -> None:
        print_safely(text, self.stream, end="")


def print_safely(text: str, stream: TextIO | None = None, end: str = "\n") -> bool:
    """Write and flush `text`; False, and nothing raised, when the stream is gone (EPIPE, EIO, closed)."""
    stream = stream if stream is not None else sys.stdout
    with contextlib.suppress(OSError, ValueError):
        stream.write(text + end)
        stream.flush()
        return True
    return False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False
