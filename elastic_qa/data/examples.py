"""QA examples: the record type that preparation produces and training and evaluation read, the error that
names bad input data, and an example's one-line stored form in the feature cache."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


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


def example_line(example: QAExample) -> bytes:
    """An example as one JSON Lines line (newline included), as the feature cache stores it."""
    answers = [[a.text, a.start] for a in example.answers]
    return json.dumps([example.id, example.question, example.context, answers]).encode() + b"\n"


def line_example(line: bytes) -> QAExample:
    """The example an `example_line` holds."""
    qid, question, context, answers = json.loads(line)
    return QAExample(qid, question, context, tuple(Answer(t, s) for t, s in answers))
