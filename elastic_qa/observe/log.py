"""structlog JSON lines, one file per process, every line stamped with who wrote it.

Event names (`worker_start`, `step`, `eval`, `checkpoint_committed`, `resume` ...) and their fields are an
interface: the chaos verifier, the report renderer and users' own tools read them.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import structlog

# Fields added to every line: rank, local_rank, world_size, node, pid, attempt. A plain dict rather than
# contextvars, so that background threads (the checkpoint writer, the agent watchdog) carry them too.
_STATIC: dict[str, Any] = {}
_lock = threading.Lock()
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _add_static(_logger: Any, _method: str, event_dict: dict) -> dict:
    for key, value in _STATIC.items():
        event_dict.setdefault(key, value)
    event_dict["ts"] = round(time.time(), 6)
    return event_dict


class _JsonLinesFile:
    """A thread-safe line writer; warnings and errors are echoed to stderr so they are never missed."""

    def __init__(self, stream: TextIO, echo: bool) -> None:
        self.stream = stream
        self.echo = echo

    def msg(self, message: str) -> None:
        with _lock:
            self.stream.write(message + "\n")
            self.stream.flush()

    def echo_line(self, message: str) -> None:
        if self.echo:
            sys.stderr.write(message + "\n")

    def __getattr__(self, _name: str) -> Any:
        return self.msg


def _echo_problems(logger: Any, method: str, event_dict: dict) -> dict:
    if method in ("warning", "error", "critical", "exception") and isinstance(logger, _JsonLinesFile):
        fields = " ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("ts", "time", "level"))
        logger.echo_line(f"[{method}] {fields}")
    return event_dict


def process_identity() -> dict[str, Any]:
    env = os.environ
    return {
        "rank": int(env.get("RANK", 0)),
        "local_rank": int(env.get("LOCAL_RANK", 0)),
        "world_size": int(env.get("WORLD_SIZE", 1)),
        "node": f"{socket.gethostname()}/{env.get('GROUP_RANK', 0)}",
        "pid": os.getpid(),
    }


def configure_logging(log_dir: str | Path | None, level: str = "info", **static: Any) -> Path | None:
    """Log JSON lines to `<log_dir>/rank-<r>.pid-<pid>.jsonl` (stderr when log_dir is None)."""
    _STATIC.clear()
    _STATIC.update(process_identity())
    _STATIC.update(static)
    path = None
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / f"rank-{_STATIC['rank']:03d}.pid-{_STATIC['pid']}.jsonl"
        sink = _JsonLinesFile(open(path, "a", encoding="utf-8"), echo=True)  # noqa: SIM115 (process-long)
    else:
        sink = _JsonLinesFile(sys.stderr, echo=False)
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


def update_identity(**fields: Any) -> None:
    """Change stamped fields (world_size after init, attempt after fencing)."""
    _STATIC.update(fields)


def get_logger() -> Any:
    return structlog.get_logger()
