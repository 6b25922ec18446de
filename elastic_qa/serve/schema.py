"""The body of POST /v1/answer, checked: one question or a list of them, each within the limits.

    {"question": "...", "context": "..."}                     one answer: ask --json's object
    {"questions": [{"question": "...", "context": "..."}, ...]}   {"answers": [one object per question]}

A bad body raises BadRequest with the HTTP status and one message naming the field, e.g.
`questions[3].context: expected a string`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from elastic_qa.serve.batcher import Pair


@dataclass(frozen=True)
class Limits:
    """What one request may hold; beyond it the request is refused with a 4xx that says which limit."""

    max_body_bytes: int = 1 << 20  # 413 beyond
    max_questions: int = 64  # questions in one request
    max_question_chars: int = 1_000
    max_context_chars: int = 20_000  # a long context costs one model window per doc_stride tokens


class BadRequest(Exception):
    """A request refused before it reaches the model: its HTTP status and what was wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_questions(body: bytes, limits: Limits) -> tuple[list[Pair], bool]:
    """The (question, context) pairs of a body, and whether it was the single-question form."""
    try:
        # No field takes a number, so an integer is only ever named: float() reads any length of digits,
        # where int() raises past 4300 (a ValueError that is no fault of the JSON).
        value = json.loads(body, parse_int=float)
    except RecursionError:
        raise BadRequest(400, "body: JSON nested too deeply") from None
    except ValueError as err:  # not UTF-8 (UnicodeDecodeError) or not JSON (JSONDecodeError)
        raise BadRequest(400, f"body: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise BadRequest(400, f"body: expected a JSON object, got {_kind(value)}")
    if "questions" in value:
        unknown = set(value) - {"questions"}
        if unknown:
            raise BadRequest(400, f"{sorted(unknown)[0]}: unknown field beside questions")
        items = value["questions"]
        if not isinstance(items, list):
            raise BadRequest(400, f"questions: expected a list, got {_kind(items)}")
        if not items:
            raise BadRequest(400, "questions: empty (give at least one)")
        if len(items) > limits.max_questions:
            raise BadRequest(
                413, f"questions: {len(items)} questions, at most {limits.max_questions} in one request"
            )
        return [_pair(item, f"questions[{i}]", limits) for i, item in enumerate(items)], False
    return [_pair(value, "", limits)], True


def _pair(item: Any, where: str, limits: Limits) -> Pair:
    prefix = f"{where}." if where else ""
    if not isinstance(item, dict):
        raise BadRequest(400, f"{where}: expected an object with question and context, got {_kind(item)}")
    unknown = set(item) - {"question", "context"}
    if unknown:
        raise BadRequest(400, f"{prefix}{sorted(unknown)[0]}: unknown field (expected question and context)")
    fields = []
    for name, most in (("question", limits.max_question_chars), ("context", limits.max_context_chars)):
        if name not in item:
            raise BadRequest(400, f"{prefix}{name}: missing")
        text = item[name]
        if not isinstance(text, str):
            raise BadRequest(400, f"{prefix}{name}: expected a string, got {_kind(text)}")
        if not text.strip():
            raise BadRequest(400, f"{prefix}{name}: empty")
        if len(text) > most:
            raise BadRequest(413, f"{prefix}{name}: {len(text)} characters, at most {most}")
        try:  # "\ud800" is JSON, but no text: the tokenizer and the reply need UTF-8
            text.encode()
        except UnicodeEncodeError as err:
            lone = f"character {err.start} is a lone surrogate ({text[err.start]!r}), not text"
            raise BadRequest(400, f"{prefix}{name}: {lone}") from None
        fields.append(text)
    return fields[0], fields[1]


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")
