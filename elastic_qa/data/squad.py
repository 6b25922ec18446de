"""SQuAD v1.1 / v2.0 JSON -> QA examples, read through fsspec so a path or any URL works."""

from __future__ import annotations

import json
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
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{url}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{url}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None


def _parse_qa(qa: Any, context: str) -> QAExample:
    if not isinstance(qa, dict):
        raise ValueError("a qas entry is not an object")
    qid, question = qa.get("id"), qa.get("question")
    if not isinstance(qid, str) or not qid:
        raise ValueError("missing string 'id'")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing or empty 'question'")
    impossible = qa.get("is_impossible", False)
    if not isinstance(impossible, bool):
        raise ValueError(f"'is_impossible' must be true or false, not {impossible!r}")
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
                raise ValueError(f"answer needs a non-empty 'text' and an integer 'answer_start': {raw!r}")
            if start < 0 or context[start : start + len(text)] != text:
                raise ValueError(f"answer {text!r} is not at answer_start={start} of the context")
            answers.append(Answer(text, start))
    return QAExample(qid, question, context, tuple(answers))


def parse_squad(doc: Any, url: str, skip_malformed: bool = False) -> tuple[list[QAExample], int]:
    """Examples in file order and the number of malformed records skipped (0 unless skip_malformed)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f"{url}: not SQuAD JSON (expected an object with a 'data' list)")
    examples: list[QAExample] = []
    skipped = 0
    for a, article in enumerate(doc["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise DataError(f"{url}: data[{a}]: expected a 'paragraphs' list")
        for p, paragraph in enumerate(paragraphs):
            where = f"data[{a}].paragraphs[{p}]"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not isinstance(qas, list):
                if not skip_malformed:
                    raise DataError(f"{url}: {where}: expected a string 'context' and a 'qas' list")
                skipped += len(qas) if isinstance(qas, list) else 1
                continue
            for q, qa in enumerate(qas):
                try:
                    examples.append(_parse_qa(qa, context))
                except ValueError as err:
                    qid = qa.get("id") if isinstance(qa, dict) else None
                    record = f"{where}.qas[{q}]" + (f" (id {qid})" if qid else "")
                    if not skip_malformed:
                        raise DataError(f"{url}: {record}: {err}") from None
                    skipped += 1
    if skipped:
        get_logger().warning("malformed_records_skipped", source=url, skipped=skipped, kept=len(examples))
    if not examples:
        raise DataError(f"{url}: no usable questions")
    return examples, skipped


def read_squad(url: str, skip_malformed: bool = False) -> tuple[list[QAExample], int]:
    return parse_squad(decode_json(read_bytes(url), url), url, skip_malformed)
