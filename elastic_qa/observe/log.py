"""structlog JSON lines, one file per process, every line stamped with who wrote it.

Event names (`worker_start`, `step`, `eval`, `checkpoint_committed`, `resume` ...) and their fields are an
interface: the chaos verifier, the report renderer and users' own tools read them.

Logging never stops training: a log line that cannot be written (the run directory's disk is full, the
file system reports EIO, stderr is a closed pipe) is dropped and counted, and the process says so once on
stderr. Before this, ENOSPC from the step log's flush crashed the trainer and lost every step since the
last checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TextIO, cast

import structlog
from structlog.typing import EventDict

from elastic_qa.network import peer_facing_address
from elastic_qa.observe.events import Event

# Fields added to every line: rank, local_rank, world_size, node, pid, attempt. A plain dict rather than
# contextvars, so that background threads (the checkpoint writer, the agent watchdog) carry them too.
_STATIC: dict[str, Any] = {}
_lock = threading.Lock()
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _add_static(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    for key, value in _STATIC.items():
        event_dict.setdefault(key, value)
    event_dict.setdefault("ts", round(time.time(), 6))  # a line written late may carry when it happened
    return event_dict


def write_stderr(text: str) -> None:
    """A line on stderr that cannot fail: the terminal may be gone (EIO) or a closed pipe (EPIPE)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class _JsonLinesFile:
    """A thread-safe line writer that never raises; warnings and errors are also echoed to stderr.

    `stream` is a file opened unbuffered in binary append mode (each line is one write(2), so a killed
    process leaves at most its last line torn) or a text stream (stderr). A write or flush that fails
    drops the line and counts it; the first failure is reported once on stderr, and the first line that
    succeeds afterwards is preceded by a `log_lines_dropped` line. Part of a line that a full disk cut
    short is cut off the file again (each file has one writer), so readers never see half a line joined
    to the next; where that fails the next line starts with a newline, leaving the fragment on a line of
    its own that readers skip. While `fault_file` exists every write fails with ENOSPC (the chaos
    `log-full` fault; checking is one stat, far less than rendering the line).
    """

    def __init__(
        self, stream: BinaryIO | TextIO, echo: bool, fault_file: str | Path | None = None, name: str = ""
    ) -> None:
        self.stream = stream
        self.echo = echo
        self.name = name or str(getattr(stream, "name", "log stream"))
        self.fault_file = str(fault_file) if fault_file else ""
        self.dropped = 0  # lines lost since the process started
        self._gap = 0  # lines lost since the last line that was written
        self._gap_since: float | None = None
        self._torn = 0  # bytes of the last failed write at the end of the file, to be cut off
        self._fragment = False  # the file may end in a torn line that could not be cut off
        self._reported = False
        self._text = isinstance(stream, io.TextIOBase)

    def msg(self, message: str) -> None:
        with _lock:
            try:
                if self._gap:
                    self._write(self._dropped_line() + "\n")
                    self._gap, self._gap_since = 0, None
                self._write(message + "\n")
                return
            except (OSError, ValueError) as err:  # ValueError: the stream was closed
                report = self._failed(err)
        if report:  # outside the lock: stderr may be a pipe that nobody reads
            write_stderr(report)

    def echo_line(self, message: str) -> None:
        if self.echo:
            write_stderr(message)

    def __getattr__(self, _name: str) -> Any:
        return self.msg

    def _write(self, text: str) -> None:
        if self.fault_file and os.path.exists(self.fault_file):
            raise OSError(errno.ENOSPC, f"injected log fault ({self.fault_file} exists)", self.name)
        if self._torn and not self._cut_torn_line():
            self._fragment, self._torn = True, 0
        if self._fragment:
            text = "\n" + text
        # `_text` is isinstance(stream, io.TextIOBase), taken once: the casts only tell the type checker.
        if self._text:
            text_stream = cast(TextIO, self.stream)
            text_stream.write(text)
            text_stream.flush()
        else:
            binary_stream = cast(BinaryIO, self.stream)
            data = memoryview(text.encode("utf-8"))
            while data:
                written = binary_stream.write(data)
                if written is None:  # a non-blocking stream that would block
                    raise OSError(errno.EAGAIN, "log stream would block", self.name)
                self._torn += written
                data = data[written:]
        self._torn, self._fragment = 0, False

    def _cut_torn_line(self) -> bool:
        try:
            end = self.stream.seek(0, os.SEEK_END)
            self.stream.truncate(max(0, end - self._torn))
        except (OSError, ValueError, AttributeError):
            return False
        self._torn = 0
        return True

    def _failed(self, err: Exception) -> str | None:
        if self._torn:
            self._cut_torn_line()
        self.dropped += 1
        self._gap += 1
        self._gap_since = self._gap_since or time.time()
        if self._reported:
            return None
        self._reported = True
        return (
            f"elastic-qa: cannot write the log {self.name} ({type(err).__name__}: {err}); "
            "training goes on, log lines are dropped until writing works again"
        )

    def _dropped_line(self) -> str:
        fields = {
            "event": Event.LOG_LINES_DROPPED,
            "lines": self._gap,
            "since_ts": self._gap_since,
            "total": self.dropped,
            "level": "warning",
            **_STATIC,
            "ts": round(time.time(), 6),
        }
        return json.dumps(fields, default=str)


# Events whose caller also says so in a plain sentence (stderr, or the console for diagnoses and config
# warnings): echoing them too would say it twice.
_SAID_BY_CALLER = frozenset(
    {
        "bad_input",
        "checkpoint_fatal",
        "checkpoint_lost",
        "checkpoint_node_local_only",
        "diagnosis",
        "config_warning",
    }
)


def _echo_problems(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    if event_dict.get("event") in _SAID_BY_CALLER:
        return event_dict
    if method in ("warning", "error", "critical", "exception") and isinstance(logger, _JsonLinesFile):
        fields = " ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("ts", "time", "level"))
        logger.echo_line(f"[{method}] {fields}")
    return event_dict


NODE_ENV = "ELASTIC_QA_NODE"  # set by `elastic-qa node`: this host's name as the logs give it


def node_name() -> str:
    """This host as the logs name it: `hostname@address`, the address being the one its peers reach it by.

    A hostname alone is not enough: containers often share one, and so do hosts left with a distribution's
    default. `elastic-qa node` passes the name it computed; a worker started by plain torchrun takes the
    address it routes to rank 0's store from (MASTER_ADDR), and the bare hostname when that is loopback.
    """
    given = os.environ.get(NODE_ENV)
    if given:
        return given
    address = peer_facing_address(os.environ.get("MASTER_ADDR"))
    return f"{socket.gethostname()}@{address}" if address else socket.gethostname()


def file_safe(text: str) -> str:
    """`text` with every character a file name should not hold (/, :, spaces ...) replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9@._-]", "_", text)


def process_identity() -> dict[str, Any]:
    env = os.environ
    return {
        "rank": int(env.get("RANK", 0)),
        "local_rank": int(env.get("LOCAL_RANK", 0)),
        "world_size": int(env.get("WORLD_SIZE", 1)),
        "node": f"{node_name()}/{env.get('GROUP_RANK', 0)}",
        "pid": os.getpid(),
    }


def log_file_name(rank: int, node: str, pid: int) -> str:
    """`rank-<r>.<host>.pid-<pid>.jsonl`: unique in a run directory that several hosts share (pids repeat
    across hosts; the host part is `node_name()`)."""
    return f"rank-{rank:03d}.{file_safe(node.rsplit('/', 1)[0])}.pid-{pid}.jsonl"


def configure_logging(
    log_dir: str | Path | None, level: str = "info", fault_file: str | Path | None = None, **static: Any
) -> Path | None:
    """Log JSON lines to `<log_dir>/rank-<r>.<host>.pid-<pid>.jsonl` (stderr when log_dir is None).

    Raises OSError when the log directory or file cannot be created (the caller says so and exits); once
    open, nothing written to it raises.
    """
    _STATIC.clear()
    _STATIC.update(process_identity())
    _STATIC.update(static)
    path = None
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / log_file_name(_STATIC["rank"], _STATIC["node"], _STATIC["pid"])
        stream = open(path, "ab", buffering=0)  # noqa: SIM115 (process-long)
        sink = _JsonLinesFile(stream, echo=True, fault_file=fault_file, name=str(path))
    else:
        sink = _JsonLinesFile(sys.stderr, echo=False, fault_file=fault_file, name="stderr")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            _add_static,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            _echo_problems,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *_: sink,
        cache_logger_on_first_use=False,
    )
    return path


def configure_terminal_logging() -> None:
    """For commands a person runs (the launcher, `elastic-qa prepare`): warnings and errors of in-process
    work as one plain line each on stderr, info events not at all (no JSON beside the command's output)."""

    def sentence(_logger: Any, method: str, event_dict: EventDict) -> str:
        event = event_dict.pop("event", "")
        fields = ", ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("level", "ts", "time"))
        return f"elastic-qa: {method}: {event}" + (f" ({fields})" if fields else "")

    structlog.configure(
        processors=[sentence],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=lambda *_: _JsonLinesFile(sys.stderr, echo=False, name="stderr"),
        cache_logger_on_first_use=False,
    )


def update_identity(**fields: Any) -> None:
    """Change stamped fields (world_size after init, attempt after fencing)."""
    _STATIC.update(fields)


class EventLog(Protocol):
    """What the product calls on a logger: one JSON line per call, `event` (an Event or a plain name) and
    its fields. structlog's bound logger is one; a test may pass its own."""

    def debug(self, event: str, /, **fields: Any) -> Any: ...

    def info(self, event: str, /, **fields: Any) -> Any: ...

    def warning(self, event: str, /, **fields: Any) -> Any: ...

    def error(self, event: str, /, **fields: Any) -> Any: ...

    def exception(self, event: str, /, **fields: Any) -> Any: ...


def get_logger() -> EventLog:
    logger: EventLog = structlog.get_logger()
    return logger
