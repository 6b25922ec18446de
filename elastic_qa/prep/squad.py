"""SQuAD records -> QA examples: each record's checks, and the walk over SQuAD v1.1 / v2.0 articles that
names every malformed record's place."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Iterable, Iterator
from typing import Any

from elastic_qa.data.examples import Answer, DataError, QAExample

# Values from the file are shown escaped, shortened and only a few levels deep: an error message is one
# line of readable length whatever the record holds (a newline, a megabyte, a 900-level list).
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlevel = 3


def _show(value: Any) -> str:
    return _SHOWN.repr(value)


def shown_id(qid: Any) -> str:
    """A question id as written when it is plain printable text, else escaped."""
    if isinstance(qid, str) and qid.isprintable() and len(qid) <= 60:
        return qid
    return _show(qid)


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def require_text(text: str, what: str) -> None:
    """JSON can escape a lone UTF-16 surrogate (\\ud800), which is no character: it cannot be encoded
    later (tokeniser, cache, predictions), so it is refused here, with the record still known."""
    if not text.isascii():
        found = _SURROGATE.search(text)
        if found:
            raise ValueError(
                f"{what} holds a lone surrogate \\u{ord(found.group()):04x} at character {found.start()}"
            )


def parse_qa(qa: Any, context: str) -> QAExample:
    if not isinstance(qa, dict):
        raise ValueError("a qas entry is not an object")
    qid, question = qa.get("id"), qa.get("question")
    if not isinstance(qid, str) or not qid:
        raise ValueError("missing string 'id'")
    require_text(qid, "'id'")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing or empty 'question'")
    require_text(question, "'question'")
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


class Tally:
    """Malformed records skipped while validating records."""

    def __init__(self) -> None:
        self.skipped = 0


def squad_records(
    url: str, articles: Iterable[Any], skip_malformed: bool, tally: Tally
) -> Iterator[tuple[str, QAExample]]:
    """(record name, example) of SQuAD articles in order; a malformed one raises or is counted."""
    for a, article in enumerate(articles):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            bad_article(url, a, skip_malformed, tally)
            continue
        for p, paragraph in enumerate(paragraphs):
            yield from paragraph_records(url, f"data[{a}].paragraphs[{p}]", paragraph, skip_malformed, tally)


def bad_article(url: str, a: int, skip_malformed: bool, tally: Tally) -> None:
    if not skip_malformed:
        raise DataError(f"{url}: data[{a}]: expected a 'paragraphs' list")
    tally.skipped += 1


def paragraph_records(
    url: str, where: str, paragraph: Any, skip_malformed: bool, tally: Tally
) -> Iterator[tuple[str, QAExample]]:
    """(record name, example) of one paragraph (`where` names it); a malformed one raises or is counted."""
    context = paragraph.get("context") if isinstance(paragraph, dict) else None
    qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
    try:
        if not isinstance(context, str) or not isinstance(qas, list):
            raise ValueError("expected a string 'context' and a 'qas' list")
        require_text(context, "'context'")
    except ValueError as err:
        if not skip_malformed:
            raise DataError(f"{url}: {where}: {err}") from None
        tally.skipped += len(qas) if isinstance(qas, list) else 1
        return
    for q, qa in enumerate(qas):
        record = f"{where}.qas[{q}]"
        try:
            yield record, parse_qa(qa, context)
        except (ValueError, RecursionError) as err:
            if not skip_malformed:
                raise DataError(f"{url}: {named(record, qa)}: {err}") from None
            tally.skipped += 1


def named(record: str, raw: Any) -> str:
    """A record's place, with its id when it has one."""
    qid = raw.get("id") if isinstance(raw, dict) else None
    return record + (f" (id {shown_id(qid)})" if qid else "")
