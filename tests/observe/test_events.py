"""The events that cross processes: every name a reader compares with is one a writer writes, and every writer
of an event passes the fields its readers use (elastic_qa/observe/events.py)."""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest

from elastic_qa.observe.events import (
    COMMON,
    EVENT_OF_RECORD,
    FIELDS,
    RECORDS,
    TYPES,
    VIEWS,
    AgentExitRecord,
    AgentStartedRecord,
    AttemptStartRecord,
    CheckpointCommittedRecord,
    EvalRecord,
    Event,
    JobEndRecord,
    LogLinesDroppedRecord,
    ResumeRecord,
    StepProgressRecord,
    StepRecord,
    TrainDoneRecord,
    WorkerStartRecord,
    conforms,
    event_of,
    record,
    records,
    runtime_type,
)
from tests.conftest import REPO

LEVELS = {"info", "warning", "error", "debug", "exception", "critical"}


def modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted((REPO / "elastic_qa").rglob("*.py"))]


def member(node: ast.AST) -> Event | None:
    """`Event.X` as the Event it names."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Event":
        return Event[node.attr]
    return None


def written(node: ast.AST) -> tuple[ast.expr, ast.Call | None] | None:
    """Where `node` writes an event: the name's expression and the call (None for a dict literal)."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in LEVELS and node.args:
            return node.args[0], node
        if isinstance(func, ast.Name) and func.id == "log_action" and len(node.args) > 1:
            return node.args[1], node
        if isinstance(func, ast.Attribute) and func.attr == "record" and node.args:  # replica/launch.py
            return node.args[0], node
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "event":
                return value, None
    return None


def writers() -> list[tuple[str, Event, ast.Call | None]]:
    found = []
    for path, tree in modules():
        for node in ast.walk(tree):
            spot = written(node)
            if spot is not None and (event := member(spot[0])) is not None:
                found.append((f"{path.relative_to(REPO)}:{node.lineno}", event, spot[1]))
    return found


def is_event_field(node: ast.AST) -> bool:
    """`row.get("event")` or `row["event"]`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == "event"
    )


def test_every_event_named_is_written_by_some_writer() -> None:
    """An Event that no writer writes (a renamed or removed event) fails here, with every reader of it."""
    produced = {event for _, event, _ in writers()}
    read: dict[Event, list[str]] = {}
    for path, tree in modules():
        spots = {id(spot[0]) for node in ast.walk(tree) if (spot := written(node)) is not None}
        for node in ast.walk(tree):
            if (event := member(node)) is not None and id(node) not in spots:
                read.setdefault(event, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert len(read) >= 20, read
    assert {e: where for e, where in read.items() if e not in produced} == {}
    assert set(Event) - produced == set(), "an Event no writer writes"


def test_no_reader_compares_an_event_name_with_a_plain_string() -> None:
    """Readers name events by Event, so that a renamed one is one edit the tests above check."""
    plain = []
    for path, tree in modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not is_event_field(node.left):
                continue
            for other in node.comparators:
                items = other.elts if isinstance(other, ast.Tuple | ast.Set | ast.List) else [other]
                if any(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in items):
                    plain.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert plain == []


def test_no_writer_names_a_known_event_by_a_plain_string() -> None:
    plain = []
    for path, tree in modules():
        for node in ast.walk(tree):
            spot = written(node)
            if spot is not None and isinstance(spot[0], ast.Constant) and spot[0].value in set(Event):
                plain.append(f"{path.relative_to(REPO)}:{node.lineno} {spot[0].value}")
    assert plain == []


def test_every_writer_of_an_event_passes_the_fields_its_readers_use() -> None:
    missing = []
    for where, event, call in writers():
        if call is None or event not in FIELDS or any(k.arg is None for k in call.keywords):
            continue  # a dict literal, no fields asked, or **fields (not checkable here)
        passed = {k.arg for k in call.keywords}
        if lacking := set(FIELDS[event]) - passed - set(COMMON):
            missing.append(f"{where} {event.value} lacks {sorted(lacking)}")
    assert missing == []


def test_an_event_name_is_written_and_compared_as_its_plain_string() -> None:
    line = json.dumps({"event": Event.STEP, "step": 1})
    assert json.loads(line) == {"event": "step", "step": 1}
    assert f"{Event.STEP}" == str(Event.STEP) == "step" and Event.STEP == "step"
    assert event_of(json.loads(line)) is Event.STEP
    assert event_of({"event": "no_such_event"}) is None and event_of({"event": ["step"]}) is None


@pytest.mark.parametrize(
    "row",
    [
        {"event": "step", "step": "5"},
        {"event": "step", "step": 5, "rank": [0]},
        {"event": "step", "step": True},
        {"event": "step", "step": 5, "loss": "nan"},
        {"event": "step", "step": 5, "ts": float("inf")},
        {"event": "worker_start", "pid": 1.5},
        {"event": "log_lines_dropped", "since_ts": float("nan")},
    ],
)
def test_a_record_whose_fields_are_of_other_types_does_not_conform(row: dict) -> None:
    assert not conforms(row)


def test_the_records_writers_write_conform() -> None:
    assert conforms({"event": "step", "step": 5, "loss": float("nan"), "lr": 1e-4, "ts": 1.5, "rank": 0})
    assert conforms({"event": "unknown_one", "whatever": [1]})
    assert conforms({"event": "train_done", "step": 3, "em": 1.0})


def test_every_record_names_one_event_and_fields_derive_from_the_records() -> None:
    """One record per event; FIELDS (what every writer passes) is each record's required keys with their
    types, and TYPES every key's: nothing is listed twice."""
    named = [EVENT_OF_RECORD[kind] for kind in RECORDS]
    assert all(isinstance(event, Event) for event in named) and len(set(named)) == len(RECORDS)
    assert set(FIELDS) == set(TYPES) == set(named)
    for kind in RECORDS:
        event = EVENT_OF_RECORD[kind]
        assert typing.get_type_hints(kind)["event"] == typing.Literal[event]
        assert set(FIELDS[event]) == kind.__required_keys__ - {"event"}
        assert set(TYPES[event]) == set(typing.get_type_hints(kind)) - {"event"}
        assert set(COMMON) <= kind.__optional_keys__  # the launcher's lines carry none of a worker's
    assert FIELDS[Event.STEP] == {
        "step": int,
        "loss": (int, float),
        "lr": (int, float),
        "samples_per_s": (int, float),
    }
    assert "grad_norm" in TYPES[Event.STEP] and "grad_norm" not in FIELDS[Event.STEP]
    assert TYPES[Event.RESUME]["saved_world_size"] == (int, type(None))


STEP = {"event": "step", "step": 5, "loss": 0.5, "lr": 1e-4, "samples_per_s": 10, "ts": 1.5, "rank": 0}


def test_record_reads_a_row_as_its_event_record_or_refuses_it() -> None:
    assert record(STEP, StepRecord) == STEP
    assert record({**STEP, "loss": float("nan"), "recovered": True}, StepRecord) is not None
    assert record(STEP, EvalRecord) is None  # another event
    assert record({k: v for k, v in STEP.items() if k != "lr"}, StepRecord) is None  # a required field
    assert record({"event": "eval", "step": 5}, EvalRecord) is not None  # the scores are optional
    assert records([STEP, {"event": "eval", "step": 5}, {**STEP, "step": 6}], StepRecord) == [
        STEP,
        {**STEP, "step": 6},
    ]


@pytest.mark.parametrize(
    ("row", "kind"),
    [
        ({**STEP, "step": "5"}, StepRecord),
        ({**STEP, "lr": None}, StepRecord),
        ({**STEP, "grad_norm": "0.1"}, StepRecord),  # an optional field of the wrong type
        ({**STEP, "rank": [0]}, StepRecord),  # a field of COMMON
        ({**STEP, "ts": float("inf")}, StepRecord),
        ({**STEP, "recovered": 1}, StepRecord),
        ({"event": "eval", "step": 5, "em": True}, EvalRecord),  # bool is no number
        ({"event": "resume", "step": 5, "saved_world_size": "2"}, ResumeRecord),
        ({"event": "agent_exit", "agent": 0, "code": 1.5}, AgentExitRecord),
        ({"event": "job_end", "exit_codes": [0]}, JobEndRecord),
        ({"event": "log_lines_dropped", "since_ts": float("nan")}, LogLinesDroppedRecord),
    ],
)
def test_record_refuses_a_row_with_a_field_of_another_type(row: dict, kind: type) -> None:
    assert record(row, kind) is None


def test_the_lines_producers_write_parse_as_their_records(tmp_path: Path) -> None:
    """Lines written by the real writers: a worker's through observe/log.py (as step_log, scoring, the
    trainer, the checkpoint manager and restore call it, and its own `log_lines_dropped` line), and the
    local launcher's agents/launch.jsonl through log_action."""
    import structlog

    from elastic_qa.launcher.local import log_action
    from elastic_qa.observe import log as log_module

    try:
        path = log_module.configure_logging(tmp_path / "logs", attempt=3)
        log = log_module.get_logger()
        log.info(Event.STEP, step=1, epoch=0, loss=0.5, rank_loss=0.6, lr=1e-4, grad_norm=1.25,
                 samples_per_s=12.5, world_size=1, cursor=8, ts=12.0)  # fmt: skip
        log.info(Event.EVAL, step=1, em=0.5, f1=0.75, loss=1.5, questions=4, seconds=0.1)
        log.info(Event.RESUME, step=1, path="x", node_local=False, saved_world_size=None, world_size=1,
                 epoch=0, cursor=8)  # fmt: skip
        log.info(Event.CHECKPOINT_COMMITTED, step=1, path="x", reason="periodic", attempt=3, seconds=0.1,
                 blocking_seconds=0.01, bytes=10)  # fmt: skip
        log.info(Event.TRAIN_DONE, step=1, tokens_seen=64, em=0.5, f1=0.75, eval_loss=1.5)
        with open(tmp_path / "dropped.jsonl", "ab", buffering=0) as stream:
            sink = log_module._JsonLinesFile(stream, echo=False)
            sink._gap, sink._gap_since, sink.dropped = 2, 10.5, 2
            dropped = json.loads(sink._dropped_line())
    finally:
        structlog.reset_defaults()
        log_module._STATIC.clear()
    assert path is not None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [StepRecord, EvalRecord, ResumeRecord, CheckpointCommittedRecord, TrainDoneRecord]
    parsed = [record(line, kind) for line, kind in zip(lines, kinds, strict=True)]
    assert all(rec is not None for rec in parsed), lines
    step = parsed[0]
    assert isinstance(step, dict) and (step["attempt"], step["rank"], step["grad_norm"]) == (3, 0, 1.25)
    assert record(dropped, LogLinesDroppedRecord) is not None
    log_action(tmp_path, Event.AGENT_STARTED, agent=0, pid=11, is_host=True, log="agent-0.log")
    log_action(tmp_path, Event.AGENT_EXIT, agent=0, pid=11, code=-9)
    log_action(tmp_path, Event.JOB_END, exit_codes={"0": -9})
    launcher = [json.loads(line) for line in (tmp_path / "agents" / "launch.jsonl").read_text().splitlines()]
    kinds = [AgentStartedRecord, AgentExitRecord, JobEndRecord]
    assert all(record(line, kind) is not None for line, kind in zip(launcher, kinds, strict=True)), launcher


def test_a_view_types_its_fields_as_its_events_record_and_requires_no_more() -> None:
    """A view (a looser reading of an event) leaves FIELDS and TYPES the strict record's."""
    for view in VIEWS:
        event = EVENT_OF_RECORD[view]
        hints = typing.get_type_hints(view)
        assert hints["event"] == typing.Literal[event] and view not in RECORDS
        assert {name: runtime_type(hint) for name, hint in hints.items() if name != "event"}.items() <= {
            **TYPES[event]
        }.items()
        assert view.__required_keys__ - {"event"} <= set(FIELDS[event])
    assert set(FIELDS[Event.STEP]) == {"step", "loss", "lr", "samples_per_s"}  # not weakened by the view


def test_a_view_reads_a_line_its_record_refuses_for_a_missing_field_only() -> None:
    bare = {"event": "step", "step": 5, "ts": 1.5, "rank": 0}  # a fixture's, the bench's trivial worker's
    replica = {**STEP, "quorum": 3, "participants": 2, "replica_group": 1}  # a replica group's worker's
    assert record(bare, StepRecord) is None and record(bare, StepProgressRecord) == bare
    assert record(replica, StepProgressRecord) == replica
    assert record({**bare, "step": "5"}, StepProgressRecord) is None
    assert record({**bare, "loss": "0.5"}, StepProgressRecord) is None  # typed as the record types it
    assert record({"event": "step", "ts": 1.5}, StepProgressRecord) is None
    start = {"event": "worker_start", "attempt": 2, "pid": 7, "ts": 1.0}  # no backend
    assert record(start, AttemptStartRecord) == start
    assert records([start, bare], AttemptStartRecord) == [start]
    single = {**start, "backend": None, "device": "cpu"}  # a single process has no process group (dist.py)
    assert record(single, WorkerStartRecord) == single and record(start, WorkerStartRecord) is None
