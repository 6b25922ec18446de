"""The events that cross processes: their names and the fields their readers rely on, in one place.

A worker's JSON lines (observe/log.py), the launcher's `agents/launch.jsonl` and a node's `nodes/*.jsonl` are
read by other processes: the launcher's terminal, chaos's verdict, the benchmarks, the report and the
dashboard. Both sides name an event by `Event` (a str: it is written and compared as its plain name), so a
renamed event is one edit, and tests/observe/test_events.py checks that every event a reader compares with
is one that some writer writes, and that every writer of an event passes the fields `FIELDS` says its
readers use. `conforms` tells a record whose fields have the types the readers expect from one written by
something else (a hand-edited or hostile line): readers that must not break on one use it.

Every line also carries what observe/log.py adds to all of them (`COMMON`): ts, rank, local_rank,
world_size, node, pid, attempt (a worker's lines), or ts (and node) for the launcher's and a node's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum
from typing import Any


class Event(str, Enum):
    """An event's name: equal to, hashed as and written (JSON, str(), f-strings) as the plain string."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # the plain string's, as str() above

    # the worker (trainer, session, checkpoints, signals, entry point)
    WORKER_START = "worker_start"
    STARTUP = "startup"
    TRAIN_START = "train_start"
    RESUME = "resume"
    START_FRESH = "start_fresh"
    CONFIG_CHANGED = "config_changed"
    STEP = "step"
    EVAL = "eval"
    DIAGNOSIS = "diagnosis"
    STEP_BREAKDOWN = "step_breakdown"
    FROZEN_PARAMETERS = "frozen_parameters"
    COMPILE = "compile"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_FENCED = "checkpoint_fenced"
    CHECKPOINT_PRUNED = "checkpoint_pruned"
    CHECKPOINT_QUARANTINED = "checkpoint_quarantined"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    CHECKPOINT_WAIT = "checkpoint_wait"
    EMERGENCY_CHECKPOINT = "emergency_checkpoint"
    STOP_REQUESTED = "stop_requested"
    STOPPING = "stopping"
    TRAIN_DONE = "train_done"
    WORKER_CRASH = "worker_crash"
    BAD_INPUT = "bad_input"
    PEER_FAILURE = "peer_failure"
    AGENT_LOST = "agent_lost"
    DEBUG_KILL = "debug_kill"
    LOG_LINES_DROPPED = "log_lines_dropped"
    # the local launcher (agents/launch.jsonl)
    JOB_START = "job_start"
    AGENT_STARTED = "agent_started"
    AGENT_EXIT = "agent_exit"
    AGENT_LEAVE = "agent_leave"
    AGENT_STOP = "agent_stop"
    STOP_ALL = "stop_all"
    CRASH_LOOP = "crash_loop"
    JOB_END = "job_end"


# Fields added to every line of a worker by observe/log.py (the launcher's lines carry ts).
COMMON: Mapping[str, type | tuple[type, ...]] = {
    "ts": (int, float),
    "rank": int,
    "local_rank": int,
    "world_size": int,
    "node": str,
    "pid": int,
    "attempt": int,
}
_NUMBER = (int, float)
_TIMES = ("ts", "since_ts")

# The fields some reader of the event relies on, beyond COMMON, with their types: every writer passes them.
FIELDS: Mapping[Event, Mapping[str, type | tuple[type, ...]]] = {
    Event.WORKER_START: {"backend": str},
    Event.TRAIN_START: {"step": int, "max_steps": int},
    Event.RESUME: {"step": int},
    Event.STEP: {"step": int, "loss": _NUMBER, "lr": _NUMBER, "samples_per_s": _NUMBER},
    Event.EVAL: {"step": int},
    Event.CHECKPOINT_COMMITTED: {"step": int},
    Event.CHECKPOINT_FAILED: {"step": int},
    Event.CHECKPOINT_PRUNED: {"step": int},
    Event.EMERGENCY_CHECKPOINT: {"step": int},
    Event.STOPPING: {"step": int},
    Event.TRAIN_DONE: {"step": int},
    Event.WORKER_CRASH: {"error": str},
    Event.BAD_INPUT: {"error": str},
    Event.LOG_LINES_DROPPED: {"since_ts": _NUMBER},
    Event.AGENT_EXIT: {"agent": int},
    Event.AGENT_STARTED: {"agent": int},
}


def event_of(row: Mapping[str, Any]) -> Event | None:
    """The Event a record is, or None (not one the readers know, or no name)."""
    name = row.get("event")
    try:
        return Event(name) if isinstance(name, str) else None
    except ValueError:
        return None


def conforms(row: Mapping[str, Any]) -> bool:
    """Whether every field of COMMON and of the event's FIELDS that `row` has is of the expected type (bool
    is no number here, and a time is finite; a loss may be NaN). Missing fields are the reader's to handle."""
    event = event_of(row)
    expected = {**COMMON, **(FIELDS.get(event, {}) if event is not None else {})}
    for name, kind in expected.items():
        if name not in row:
            continue
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            return False
        if name in _TIMES and not math.isfinite(row[name]):
            return False
    return True
