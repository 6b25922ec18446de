"""The one place where the dashboard checks what it reads from a run's files: every field of every record
that the live state, the summary and the charts use, by type and range.

A record with a field of the wrong kind (a rank that is a list, a step that is text, a time that is NaN)
is left out whole, and counted; a field that is null counts as absent. Only the fields the state reads
are kept, cut to a bounded length, so what the dashboard holds of a long run stays small and nothing
computed from it meets a value it does not expect. config.yaml is reduced the same way: its sections,
their plain values, and a `train.max_steps` that is a count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from elastic_qa.observe.events import COMMON, TYPES, Kind

TEXT_CAP = 1000  # characters kept of a text field (the page shows 300 of an error)
BIGGEST = 2**53  # counts above this are not exact as floats, which the charts draw them as
LATEST_TS = 1e11  # seconds since 1970: the year 5138


class Bad(Exception):
    """A field of the wrong kind: its record is left out."""


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value < BIGGEST:
        raise Bad
    return value


def _integer(value: Any) -> int:
    if type(value) is not int or not -BIGGEST < value < BIGGEST:
        raise Bad
    return value


def _number(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or abs(value) >= BIGGEST:
        raise Bad
    return value


def _time(value: Any) -> float:
    if type(value) not in (int, float) or not 0 <= value < LATEST_TS:  # NaN fails too
        raise Bad
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise Bad
    return value[:TEXT_CAP]


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Bad
    return value


def _codes(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or len(value) > 4096:
        raise Bad
    return {_text(k): _integer(v) for k, v in value.items()}


Schema = dict[str, Callable[[Any], Any]]
_BY_KIND: dict[Kind, Callable[[Any], Any]] = {int: _count, (int, float): _number, str: _text, bool: _flag}
_NOT_BY_KIND: Schema = {
    "event": _text, "time": _text,  # the name, and structlog's ISO time: every line's, no record's field
    "ts": _time, "code": _integer, "exit_codes": _codes,  # a time; an exit code (negative: a signal)
}  # fmt: skip


def _kind(name: str) -> Kind:
    """The one type observe/events.py gives the field `name` (None, which counts as absent, left out)."""
    kinds = {kind for fields in (COMMON, *TYPES.values()) if (kind := fields.get(name)) is not None}
    if len(kinds) != 1:
        raise TypeError(f"observe/events.py gives {name!r} {len(kinds)} types")
    (kind,) = kinds
    if isinstance(kind, tuple) and type(None) in kind:
        rest = tuple(k for k in kind if k is not type(None))
        kind = rest[0] if len(rest) == 1 else rest
    return kind


def _schema(*names: str) -> Schema:
    """A check per field: its type from observe/events.py's records, its range by that type (an int is a
    count here), and the fields named in _NOT_BY_KIND checked as they say."""
    return {name: _NOT_BY_KIND.get(name) or _BY_KIND[_kind(name)] for name in names}


LOG_FIELDS: Schema = _schema(
    "event", "ts", "time", "node", "error", "reason",
    "rank", "attempt", "world_size", "pid", "step", "max_steps", "saved_world_size",
    "loss", "rank_loss", "lr", "grad_norm", "samples_per_s", "em", "f1", "eval_loss",
    "replica_group", "quorum", "participants", "lineage", "from_step", "parent",
)  # fmt: skip
FAULT_FIELDS: Schema = {"fault": _text, "target": _text, "step": _count, "ts": _time, "skipped": _text}
LAUNCHER_FIELDS: Schema = _schema("event", "ts", "agent", "pid", "is_host", "code", "exit_codes")


def checked(row: dict[str, Any], schema: Schema, required: tuple[str, ...]) -> dict[str, Any] | None:
    """The fields of `schema` that `row` has, each checked; None when one is of the wrong kind or a
    `required` one is missing."""
    try:
        kept = {key: check(row[key]) for key, check in schema.items() if row.get(key) is not None}
    except Bad:
        return None
    return kept if all(key in kept for key in required) else None


def log_event(row: dict[str, Any]) -> dict[str, Any] | None:
    """A worker's log line as the state reads it, or None. A score (`em`) comes with its `f1` and step."""
    event = checked(row, LOG_FIELDS, ("event", "ts"))
    if event is not None and "em" in event and not ("f1" in event and "step" in event):
        return None
    return event


def fault(row: dict[str, Any]) -> dict[str, Any] | None:
    """A chaos fault record (not an action's), or None."""
    return None if "action" in row else checked(row, FAULT_FIELDS, ("fault",))


def launcher_record(row: dict[str, Any]) -> dict[str, Any] | None:
    """A local launcher record (agents/launch.jsonl), or None."""
    return checked(row, LAUNCHER_FIELDS, ("event",))


def config(raw: Any) -> dict[str, Any]:
    """What the summary reads of a config: each section's plain values (data.synthetic's too), with
    train.max_steps dropped unless it is a count."""
    if not isinstance(raw, dict):
        return {}
    kept: dict[str, Any] = {}
    for name in ("data", "model", "train", "checkpoint"):
        section = raw.get(name)
        if isinstance(section, dict):
            kept[name] = _plain(section)
    synthetic = raw.get("data", {}).get("synthetic") if "data" in kept else None
    if isinstance(synthetic, dict):
        kept["data"]["synthetic"] = _plain(synthetic)
    train = kept.get("train", {})
    if "max_steps" in train and (
        type(train["max_steps"]) is not int or not 0 <= train["max_steps"] < BIGGEST
    ):
        del train["max_steps"]
    return kept


def _plain(section: dict[Any, Any]) -> dict[str, Any]:
    return {
        str(key)[:TEXT_CAP]: value[:TEXT_CAP] if isinstance(value, str) else value
        for key, value in section.items()
        if isinstance(value, str) or (isinstance(value, (int, float)) and _fits(value))
    }


def _fits(value: float) -> bool:
    return isinstance(value, bool) or (math.isfinite(value) and abs(value) < BIGGEST)
