"""SQuAD v1.1 / v2.0 JSON -> QA examples, read through fsspec so a path or any URL works."""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

import fsspec

from elastic_qa.observe.log import get_logger


class DataError(ValueError):
    """Input data is unreadable or malformed; the message names the file and the record."""


@dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset into the context


@dataclass(frozen=True)
class QAExample:
    id: str
    question: str
    context: str
    answers: tuple[Answer, ...] = field(default_factory=tuple)  # empty: unanswerable (SQuAD v2)

    @property
    def is_impossible(self) -> bool:
        return not self.answers


def read_bytes(url: str) -> bytes:
    try:
        with fsspec.open(url, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, ValueError, ImportError) as err:
        raise DataError(f"{url}: cannot read ({err})") from None


def decode_json(raw: bytes, url: str) -> Any:
    try:
        text = raw.decode("utf-8-sig")  # editors on Windows start UTF-8 files with a BOM
    except UnicodeDecodeError as err:
        raise DataError(f"{url}: not UTF-8 text (byte {err.start})") from None
    if not text.strip():
        raise DataError(f"{url}: empty file, not SQuAD JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{url}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except RecursionError:  # the json module recurses once per level of nesting
        raise DataError(f"{url}: JSON nested too deeply to read ({_deepest(text)})") from None
    except ValueError as err:  # e.g. an integer literal longer than Python's 4300-digit limit
        raise DataError(f"{url}: unreadable JSON value ({str(err).split(':')[0]})") from None


_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _deepest(text: str) -> str:
    """Depth and position of the most deeply nested value (error path only: a pass over the text)."""
    depth = deepest = where = 0
    for match in _STRUCTURE.finditer(text):
        char = match.group()
        if char in "[{":
            depth += 1
            if depth > deepest:
                deepest, where = depth, match.start()
        elif char in "]}":
            depth -= 1
    line = text.count("\n", 0, where) + 1
    column = where - text.rfind("\n", 0, where)
    return f"{deepest} levels, deepest at line {line}, column {column}"


# Values from the file are shown escaped, shortened and only a few levels deep: an error message is one
# line of readable length whatever the record holds (a newline, a megabyte, a 900-level list).
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlevel = 3


def _show(value: Any) -> str:
    return _SHOWN.repr(value)


def _name(qid: Any) -> str:
    """A question id as written when it is plain printable text, else escaped."""
    if isinstance(qid, str) and qid.isprintable() and len(qid) <= 60:
        return qid
    return _show(qid)


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _require_text(text: str, what: str) -> None:
    """JSON can escape a lone UTF-16 surrogate (\\ud800), which is no character: it cannot be encoded
    later (tokeniser, cache, predictions), so it is refused here, with the record still known."""
    if not text.isascii():
        found = _SURROGATE.search(text)
        if found:
            raise ValueError(
                f"{what} holds a lone surrogate \\u{ord(found.group()):04x} at character {found.start()}"
            )


def _parse_qa(qa: Any, context: str) -> QAExample:
    if not isinstance(qa, dict):
        raise ValueError("a qas entry is not an object")
    qid, question = qa.get("id"), qa.get("question")
    if not isinstance(qid, str) or not qid:
        raise ValueError("missing string 'id'")
    _require_text(qid, "'id'")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing or empty 'question'")
    _require_text(question, "'question'")
    impossible = qa.get("is_impossible", False)
    if not isinstance(impossible, bool):
        raise ValueError(f"'is_impossible' must be true or false, not {_show(impossible)}")
    raw_answers = qa.get("answers", [])
    if not isinstance(raw_answers, list):
        raise ValueError("'answers' must be a list")
    answers = []
    if not impossible:
        if not raw_answers:
            raise ValueError("answerable question without answers")
        for raw in raw_answers:
            text, start = (
                (raw.get("text"), raw.get("answer_start")) if isinstance(raw, dict) else (None, None)
            )
            # A whitespace-only answer has no token to point at (it crashed the feature builder).
            if (
                not isinstance(text, str)
                or not text.strip()
                or isinstance(start, bool)
                or not isinstance(start, int)
            ):
                raise ValueError(
                    f"answer needs a non-empty 'text' and an integer 'answer_start': {_show(raw)}"
                )
            if start < 0 or context[start : start + len(text)] != text:
                raise ValueError(f"answer {_show(text)} is not at answer_start={_show(start)} of the context")
            answers.append(Answer(text, start))
    return QAExample(qid, question, context, tuple(answers))


def parse_squad(doc: Any, url: str, skip_malformed: bool = False) -> tuple[list[QAExample], int]:
    """Examples in file order and the number of malformed records skipped (0 unless skip_malformed).

    A question id seen before is malformed too: predictions and scores are keyed by id, so a duplicate
    would silently replace the first question's prediction.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f"{url}: not SQuAD JSON (expected an object with a 'data' list)")
    examples: list[QAExample] = []
    first_seen: dict[str, str] = {}  # question id -> where it first appeared
    skipped = duplicates = 0
    for a, article in enumerate(doc["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            if not skip_malformed:
                raise DataError(f"{url}: data[{a}]: expected a 'paragraphs' list")
            skipped += 1
            continue
        for p, paragraph in enumerate(paragraphs):
            where = f"data[{a}].paragraphs[{p}]"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            try:
                if not isinstance(context, str) or not isinstance(qas, list):
                    raise ValueError("expected a string 'context' and a 'qas' list")
                _require_text(context, "'context'")
            except ValueError as err:
                if not skip_malformed:
                    raise DataError(f"{url}: {where}: {err}") from None
                skipped += len(qas) if isinstance(qas, list) else 1
                continue
            for q, qa in enumerate(qas):
                record = f"{where}.qas[{q}]"
                try:
                    example = _parse_qa(qa, context)
                    if example.id in first_seen:
                        duplicates += 1
                        raise ValueError(f"duplicate id, first at {first_seen[example.id]}")
                except (ValueError, RecursionError) as err:
                    qid = qa.get("id") if isinstance(qa, dict) else None
                    if not skip_malformed:
                        named = record + (f" (id {_name(qid)})" if qid else "")
                        raise DataError(f"{url}: {named}: {err}") from None
                    skipped += 1
                    continue
                first_seen[example.id] = record
                examples.append(example)
    if skipped:
        get_logger().warning(
            "malformed_records_skipped",
            source=url,
            skipped=skipped,
            duplicate_ids=duplicates,
            kept=len(examples),
        )
    if not examples:
        raise DataError(f"{url}: no usable questions")
    return examples, skipped


def read_squad(url: str, skip_malformed: bool = False) -> tuple[list[QAExample], int]:
    return parse_squad(decode_json(read_bytes(url), url), url, skip_malformed)
