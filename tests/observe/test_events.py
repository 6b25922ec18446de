"""The events that cross processes: every name a reader compares with is one a writer writes, and every writer
of an event passes the fields its readers use (elastic_qa/observe/events.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from elastic_qa.observe.events import COMMON, FIELDS, Event, conforms, event_of
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
