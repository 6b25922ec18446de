"""SQuAD v1.1/v2.0 JSON through fsspec: parsed examples, and malformed input named by file and record."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from elastic_qa.data.examples import Answer, DataError, QAExample
from elastic_qa.prep.sources import parse_squad, read_squad

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HANDWRITTEN = FIXTURES / "squad-v2-handwritten.json"
DEV_SAMPLE = FIXTURES / "squad-v2-dev-sample.json"


def squad_doc(*qas: dict, context: str = "Paris is the capital of France.") -> dict:
    return {
        "version": "v2.0",
        "data": [{"title": "T", "paragraphs": [{"context": context, "qas": list(qas)}]}],
    }


def good_qa(qid: str = "q-good") -> dict:
    return {"id": qid, "question": "What is the capital?", "answers": [{"text": "Paris", "answer_start": 0}]}


def write(tmp_path: Path, doc, name: str = "train.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return str(path)


def test_the_handwritten_file_parses_english_chinese_and_unanswerable_questions():
    examples, skipped = read_squad(str(HANDWRITTEN))
    assert skipped == 0
    by_id = {e.id: e for e in examples}
    assert list(by_id) == ["hw-en-1", "hw-en-2", "hw-en-3", "hw-zh-1"]
    assert by_id["hw-en-1"].answers == (Answer("Warsaw", 24),)
    assert by_id["hw-en-2"].answers[0].text == "the Sorbonne"
    assert by_id["hw-en-3"].is_impossible
    assert by_id["hw-en-3"].answers == ()  # plausible_answers are not answers
    chinese = by_id["hw-zh-1"]
    assert chinese.question == "明长城的西端在哪里？"
    assert chinese.answers == (Answer("甘肃嘉峪关", 44),)
    for example in examples:
        for answer in example.answers:
            assert example.context[answer.start : answer.start + len(answer.text)] == answer.text


def test_the_dev_sample_has_8_answerable_and_6_unanswerable_questions():
    examples, skipped = read_squad(str(DEV_SAMPLE))
    assert skipped == 0
    assert len(examples) == 14
    assert sum(not e.is_impossible for e in examples) == 8
    assert sum(e.is_impossible for e in examples) == 6
    assert len({e.id for e in examples}) == 14
    first = examples[0]
    assert first.id == "56ddde6b9a695914005b9628"
    assert first.answers[0] == Answer("France", 159)


def test_examples_keep_file_order_and_every_listed_answer():
    doc = json.loads(DEV_SAMPLE.read_text())
    expected = [
        (qa["id"], len(qa["answers"]))
        for article in doc["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    examples, _ = parse_squad(doc, "dev")
    assert [(e.id, len(e.answers)) for e in examples] == expected


def test_squad_v1_records_without_is_impossible_are_answerable(tmp_path):
    examples, _ = read_squad(write(tmp_path, squad_doc(good_qa())))
    assert examples == [QAExample("q-good", "What is the capital?", "Paris is the capital of France.",
                                  (Answer("Paris", 0),))]  # fmt: skip


def test_a_memory_url_reads_like_a_file():
    url = f"memory://squad-{uuid.uuid4().hex}/dev.json"
    with fsspec.open(url, "wb") as handle:
        handle.write(HANDWRITTEN.read_bytes())
    try:
        assert read_squad(url) == read_squad(str(HANDWRITTEN))
    finally:
        fsspec.filesystem("memory").rm(url)


def test_a_file_url_reads_like_a_path():
    assert read_squad(HANDWRITTEN.as_uri()) == read_squad(str(HANDWRITTEN))


def test_a_missing_file_is_a_data_error_naming_it(tmp_path):
    missing = str(tmp_path / "absent.json")
    with pytest.raises(DataError, match=r"absent\.json"):
        read_squad(missing)
    with pytest.raises(DataError, match=r"memory://nowhere/absent\.json"):
        read_squad("memory://nowhere/absent.json")


def test_not_json_is_a_data_error_naming_the_file(tmp_path):
    path = write(tmp_path, '{"data": [', "broken.json")
    with pytest.raises(DataError) as info:
        read_squad(path)
    assert "broken.json" in str(info.value)
    assert "JSON" in str(info.value)


def test_not_utf8_is_a_data_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"data": "café"}'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.json"):
        read_squad(str(path))


@pytest.mark.parametrize("doc", [[1, 2], {"version": "v2.0"}, {"data": {"a": 1}}, "text"])
def test_json_that_is_not_squad_shaped_is_a_data_error(tmp_path, doc):
    path = write(tmp_path, doc, "shape.json")
    with pytest.raises(DataError, match=r"shape\.json"):
        read_squad(path)


def test_an_article_without_paragraphs_names_the_article(tmp_path):
    doc = {"data": [{"title": "ok", "paragraphs": []}, {"title": "bad"}]}
    with pytest.raises(DataError, match=r"data\[1\]"):
        read_squad(write(tmp_path, doc))


def test_a_paragraph_without_context_names_the_paragraph(tmp_path):
    doc = squad_doc(good_qa())
    doc["data"][0]["paragraphs"].append({"context": 7, "qas": [good_qa("q2")]})
    path = write(tmp_path, doc, "ctx.json")
    with pytest.raises(DataError) as info:
        read_squad(path)
    assert "ctx.json" in str(info.value)
    assert "data[0].paragraphs[1]" in str(info.value)


BAD_RECORDS = {
    "answer not at answer_start": {
        "id": "q-bad",
        "question": "What?",
        "answers": [{"text": "France", "answer_start": 3}],
    },
    "missing question": {"id": "q-bad", "answers": [{"text": "Paris", "answer_start": 0}]},
    "empty question": {"id": "q-bad", "question": "   ", "answers": [{"text": "Paris", "answer_start": 0}]},
    "answer_start is a string": {
        "id": "q-bad",
        "question": "What?",
        "answers": [{"text": "Paris", "answer_start": "0"}],
    },
    "answer_start is a bool": {
        "id": "q-bad",
        "question": "What?",
        "answers": [{"text": "Paris", "answer_start": False}],
    },
    "answer text is empty": {
        "id": "q-bad",
        "question": "What?",
        "answers": [{"text": "", "answer_start": 0}],
    },
    "answer text is only whitespace": {
        "id": "q-bad",
        "question": "What?",
        "answers": [{"text": " ", "answer_start": 5}],
    },
    "negative answer_start": {
        "id": "q-bad",
        "question": "What?",
        "answers": [{"text": ".", "answer_start": -1}],
    },
    "answers is not a list": {"id": "q-bad", "question": "What?", "answers": "Paris"},
    "answer is not an object": {"id": "q-bad", "question": "What?", "answers": ["Paris"]},
    "is_impossible is a string": {"id": "q-bad", "question": "What?", "answers": [], "is_impossible": "no"},
    "answerable without answers": {"id": "q-bad", "question": "What?", "answers": []},
}


@pytest.mark.parametrize("record", list(BAD_RECORDS.values()), ids=list(BAD_RECORDS))
def test_a_malformed_question_names_file_record_and_id(tmp_path, record):
    path = write(tmp_path, squad_doc(good_qa(), record), "bad.json")
    with pytest.raises(DataError) as info:
        read_squad(path)
    message = str(info.value)
    assert "bad.json" in message
    assert "data[0].paragraphs[0].qas[1]" in message
    assert "q-bad" in message


@pytest.mark.parametrize(
    "record",
    [{"question": "What?", "answers": []}, {"id": 17, "question": "What?"}, "not an object"],
    ids=["no id", "numeric id", "not an object"],
)
def test_a_question_without_a_usable_id_is_still_named_by_position(tmp_path, record):
    with pytest.raises(DataError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[1\]"):
        read_squad(write(tmp_path, squad_doc(good_qa(), record)))


def test_skip_malformed_keeps_the_good_questions_and_counts_the_rest(tmp_path):
    doc = squad_doc(good_qa("q1"), *copy.deepcopy(list(BAD_RECORDS.values())), good_qa("q2"))
    doc["data"][0]["paragraphs"].append({"context": None, "qas": [good_qa("q3"), good_qa("q4")]})
    doc["data"][0]["paragraphs"].append("not a paragraph")
    examples, skipped = read_squad(write(tmp_path, doc), skip_malformed=True)
    assert [e.id for e in examples] == ["q1", "q2"]
    assert skipped == len(BAD_RECORDS) + 2 + 1


def test_a_file_with_no_usable_question_is_a_data_error_even_when_skipping(tmp_path):
    path = write(tmp_path, squad_doc(BAD_RECORDS["missing question"]), "empty.json")
    with pytest.raises(DataError, match=r"empty\.json"):
        read_squad(path, skip_malformed=True)
