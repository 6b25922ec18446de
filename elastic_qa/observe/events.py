"""The events that cross processes: their names and the fields their readers rely on, in one place.

A worker's JSON lines (observe/log.py), the launcher's `agents/launch.jsonl` and a node's `nodes/*.jsonl` are
read by other processes: the launcher's terminal, chaos's verdict, the benchmarks, the report and the
dashboard. Both sides name an event by `Event` (a str: it is written and compared as its plain name), so a
renamed event is one edit, and tests/observe/test_events.py checks that every event a reader compares with
is one that some writer writes, and that every writer of an event passes the fields `FIELDS` says its
readers use. `conforms` tells a record whose fields have the types the readers expect from one written by
something else (a hand-edited or hostile line): readers that must not break on one use it.

Each event that readers read fields of has a TypedDict record (`StepRecord`, `ResumeRecord` ...): its
`event` Literal names the Event, its required keys are the fields every writer passes and its NotRequired
ones those some reader reads when present. `FIELDS` (required fields), `TYPES` (every field) and the
dashboard's checks (report/live_rows.py) derive from them. `record(row, StepRecord)` reads a row as one
(None for another event, a missing required field or a field of another type); `records` filters a list.
A reader that needs less than every writer passes reads through a looser view of the same event
(`StepProgressRecord`: a step line's step only, `AttemptStartRecord`), which types its fields as the record.

Every line also carries what observe/log.py adds to all of them (`COMMON`): ts, rank, local_rank,
world_size, node, pid, attempt (a worker's lines), or ts (and node) for the launcher's and a node's.
"""

import math
import sys
from collections.abc import Iterable, Mapping
from enum import Enum
from types import UnionType
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

# No `from __future__ import annotations` here: a TypedDict reads NotRequired only from evaluated annotations.
if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # Python 3.10's TypedDict knows no NotRequired
    from typing_extensions import NotRequired, TypedDict


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
    ATTEMPT_SUPERSEDED = "attempt_superseded"  # a newer group of the job registered: this one leaves
    DEBUG_KILL = "debug_kill"
    LOG_LINES_DROPPED = "log_lines_dropped"
    HOLD = "hold"  # held after a step, or before a heal's state leaves (step_holds.py: chaos runs)
    # a worker of a replica group (replica/worker.py)
    QUORUM = "quorum"
    HEAL = "heal"
    STEP_NOT_COMMITTED = "step_not_committed"
    QUORUM_WITHOUT_STATE = "quorum_without_state"
    LINEAGE = "lineage"
    LINEAGE_DISCARDED = "lineage_discarded"
    LINEAGE_FENCED = "lineage_fenced"
    NO_QUORUM = "no_quorum"
    # the replica-group launcher (agents/replicas.jsonl; replica/launch.py)
    LIGHTHOUSE_STARTED = "lighthouse_started"
    LIGHTHOUSE_STANDBY = "lighthouse_standby"
    LIGHTHOUSE_EXIT = "lighthouse_exit"
    GROUP_STARTED = "group_started"
    GROUP_EXIT = "group_exit"
    # the local launcher (agents/launch.jsonl)
    JOB_START = "job_start"
    AGENT_STARTED = "agent_started"
    AGENT_EXIT = "agent_exit"
    AGENT_LEAVE = "agent_leave"
    AGENT_STOP = "agent_stop"
    STOP_ALL = "stop_all"
    CRASH_LOOP = "crash_loop"
    JOB_END = "job_end"


class Common(TypedDict, total=False):
    """What observe/log.py adds to every line of a worker (`COMMON`); the launcher's lines carry ts."""

    ts: float
    rank: int
    local_rank: int
    world_size: int
    node: str
    pid: int
    attempt: int
    replica_group: int  # a replica group's worker (replica/worker.py)


# One record per event that a reader reads fields of: its name (the `event` Literal), the fields every
# writer passes (required: `FIELDS`) and the optional ones some reader reads (NotRequired), with their types.
# A float field accepts an int (JSON writes 2.0 as 2.0, but a hand-written line may say 2).
class WorkerStartRecord(Common):
    event: Literal[Event.WORKER_START]
    backend: str | None  # None: a single process without a process group (dist.py)
    device: NotRequired[str]


class TrainStartRecord(Common):
    event: Literal[Event.TRAIN_START]
    step: int
    max_steps: int


class ResumeRecord(Common):
    event: Literal[Event.RESUME]
    step: int
    saved_world_size: NotRequired[int | None]  # None: the manifest did not say
    cursor: NotRequired[int]  # samples consumed at the checkpoint (bench resume)


class StepRecord(Common):
    event: Literal[Event.STEP]
    step: int
    loss: float  # NaN when no sample of the step is known (a recovered line)
    lr: float
    samples_per_s: float
    rank_loss: NotRequired[float]
    grad_norm: NotRequired[float]
    recovered: NotRequired[bool]
    quorum: NotRequired[int]  # the replica mode's: the step's quorum, how many groups, which lineage
    participants: NotRequired[int]
    lineage: NotRequired[int]


class EvalRecord(Common):
    event: Literal[Event.EVAL]
    step: int
    em: NotRequired[float]
    f1: NotRequired[float]
    loss: NotRequired[float]


class TrainDoneRecord(Common):
    event: Literal[Event.TRAIN_DONE]
    step: int
    em: NotRequired[float]  # the final scores, when the run evaluates
    f1: NotRequired[float]
    eval_loss: NotRequired[float]


class CheckpointCommittedRecord(Common):
    event: Literal[Event.CHECKPOINT_COMMITTED]
    step: int
    reason: NotRequired[str]
    seconds: NotRequired[float]  # the whole save's time (bench gpu_evidence)
    blocking_seconds: NotRequired[float]  # the training loop's stall (bench throughput, gpu_evidence)


class CheckpointFailedRecord(Common):
    event: Literal[Event.CHECKPOINT_FAILED]
    step: int
    error: NotRequired[str]


class CheckpointPrunedRecord(Common):
    event: Literal[Event.CHECKPOINT_PRUNED]
    step: int


class EmergencyCheckpointRecord(Common):
    event: Literal[Event.EMERGENCY_CHECKPOINT]
    step: int


class StoppingRecord(Common):
    event: Literal[Event.STOPPING]
    step: int


class WorkerCrashRecord(Common):
    event: Literal[Event.WORKER_CRASH]
    error: str


class BadInputRecord(Common):
    event: Literal[Event.BAD_INPUT]
    error: str


class LogLinesDroppedRecord(Common):
    event: Literal[Event.LOG_LINES_DROPPED]
    since_ts: float


class AgentStartedRecord(Common):
    event: Literal[Event.AGENT_STARTED]
    agent: int
    is_host: NotRequired[bool]


class AgentExitRecord(Common):
    event: Literal[Event.AGENT_EXIT]
    agent: int
    code: NotRequired[int]


class JobEndRecord(Common):
    event: Literal[Event.JOB_END]
    exit_codes: NotRequired[dict[str, int]]


class QuorumRecord(Common):
    """A replica group's worker joined a quorum other than its last (replica/worker.py)."""

    event: Literal[Event.QUORUM]
    step: int
    quorum: int
    participants: int
    lineage: int


class HealRecord(Common):
    """A replica group took a live peer's state: now at `step` of `lineage`, was at `from_step`."""

    event: Literal[Event.HEAL]
    step: int
    from_step: int
    lineage: int


class LineageRecord(Common):
    """A replica group claimed `lineage`, continuing `parent` (0: none) after `step`."""

    event: Literal[Event.LINEAGE]
    lineage: int
    parent: int
    step: int


RECORDS: tuple[type[Any], ...] = (
    WorkerStartRecord, TrainStartRecord, ResumeRecord, StepRecord, EvalRecord, TrainDoneRecord,
    CheckpointCommittedRecord, CheckpointFailedRecord, CheckpointPrunedRecord, EmergencyCheckpointRecord,
    StoppingRecord, WorkerCrashRecord, BadInputRecord, LogLinesDroppedRecord, AgentStartedRecord,
    AgentExitRecord, JobEndRecord, QuorumRecord, HealRecord, LineageRecord,
)  # fmt: skip


# Looser views of an event, for readers that need less than every writer passes (only a step line's step,
# say): a line of a test fixture, of the bench's trivial worker or of a replica group's worker may lack the
# rest. A view names the same event, types no field otherwise than its record, and requires a subset of
# its record's fields; FIELDS and TYPES stay the records' (tests/observe/test_events.py checks this).
class StepProgressRecord(Common):
    """A step line read for its step (and COMMON's ts, rank, attempt ...); the figures may be missing."""

    event: Literal[Event.STEP]
    step: int
    loss: NotRequired[float]
    lr: NotRequired[float]
    samples_per_s: NotRequired[float]
    participants: NotRequired[int]
    lineage: NotRequired[int]


class AttemptStartRecord(Common):
    """A worker_start line read for COMMON's fields only (attempt, pid, world_size, ts): backend may be
    missing."""

    event: Literal[Event.WORKER_START]
    backend: NotRequired[str | None]


VIEWS: tuple[type[Any], ...] = (StepProgressRecord, AttemptStartRecord)

Kind = type | tuple[type, ...]


def runtime_type(annotation: Any) -> Kind:
    """What isinstance checks a field's value against: float takes an int too, `X | None` takes None,
    `dict[str, int]` is a dict (its items are the reader's)."""
    if annotation is float:
        return (int, float)
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation
    args = get_args(annotation)
    if get_origin(annotation) in (Union, UnionType):
        kinds: list[type] = []
        for arg in args:
            kind = runtime_type(arg)
            kinds += kind if isinstance(kind, tuple) else [kind]
        return tuple(kinds)
    origin = get_origin(annotation)
    if isinstance(origin, type):
        return origin
    raise TypeError(f"no runtime type for {annotation!r}")


def _event(kind: type[Any]) -> Event:
    (name,) = get_args(get_type_hints(kind)["event"])
    return Event(name)


def _types(kind: type[Any]) -> dict[str, Kind]:
    return {name: runtime_type(hint) for name, hint in get_type_hints(kind).items() if name != "event"}


# Fields added to every line of a worker by observe/log.py (the launcher's lines carry ts).
COMMON: Mapping[str, Kind] = _types(Common)
_TIMES = ("ts", "since_ts")
EVENT_OF_RECORD: Mapping[type[Any], Event] = {kind: _event(kind) for kind in RECORDS + VIEWS}
# The fields a record (or a view) requires, beyond `event`.
REQUIRED: Mapping[type[Any], frozenset[str]] = {
    kind: frozenset(kind.__required_keys__ - {"event"}) for kind in RECORDS + VIEWS
}
# Every field of an event that a reader reads, with its type (COMMON's included).
TYPES: Mapping[Event, Mapping[str, Kind]] = {_event(kind): _types(kind) for kind in RECORDS}
# The fields some reader of the event relies on, beyond COMMON, with their types: every writer passes them.
FIELDS: Mapping[Event, Mapping[str, Kind]] = {
    _event(kind): {name: kind_ for name, kind_ in _types(kind).items() if name in kind.__required_keys__}
    for kind in RECORDS
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
    expected = TYPES.get(event, COMMON) if event is not None else COMMON
    for name, kind in expected.items():
        if name not in row:
            continue
        value = row[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and not _takes_bool(kind)):
            return False
        if name in _TIMES and not math.isfinite(row[name]):
            return False
    return True


def _takes_bool(kind: Kind) -> bool:
    return bool in (kind if isinstance(kind, tuple) else (kind,))


R = TypeVar("R")


def record(row: Mapping[str, Any], kind: type[R]) -> R | None:
    """`row` as the typed record `kind` (one of RECORDS or VIEWS), or None: another event, a field `kind`
    requires missing, or a field of another type (`conforms`). Optional fields may still be missing: read
    them with .get()."""
    if (
        row.get("event") != EVENT_OF_RECORD[kind]
        or not all(name in row for name in REQUIRED[kind])
        or not conforms(row)
    ):
        return None
    return cast(R, row)


def records(rows: Iterable[Mapping[str, Any]], kind: type[R]) -> list[R]:
    """Every row of `rows` that is a `kind` record, in order (see `record`)."""
    return [rec for row in rows if (rec := record(row, kind)) is not None]
