"""Hostile SQuAD files: every one is a one-line DataError naming file and record, or skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from elastic_qa.config import ConfigError, load_config, packaged_config
from elastic_qa.data.examples import Answer, DataError, QAExample
from elastic_qa.prep.sources import parse_squad, read_squad
from elastic_qa.prep.tokenizer import ByteTokenizer, WordTokenizer
from elastic_qa.prep.windows import build_features

CONTEXT = "Paris is the capital of France."


def qa(qid: str, question: str = "What is the capital?", answer: str = "Paris", start: int = 0) -> dict:
    return {"id": qid, "question": question, "answers": [{"text": answer, "answer_start": start}]}


def doc(*paragraphs: list[dict], context: str = CONTEXT) -> dict:
    return {"data": [{"title": "T", "paragraphs": [{"context": context, "qas": p} for p in paragraphs]}]}


def write_text(tmp_path: Path, text: str, name: str = "hostile.json") -> str:
    """Raw JSON text (so escapes like \\ud800 reach the reader as written)."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def data_error(url: str, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        read_squad(url, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# 12a: nesting deeper than the json module's recursion limit


def test_a_file_nested_100k_levels_deep_is_a_data_error_naming_file_and_position(tmp_path):
    depth = 100_000
    path = write_text(tmp_path, '{"data": [' + "[" * depth + "]" * depth + "]}", "deep.json")
    message = data_error(path)
    assert "deep.json" in message
    assert "line 1" in message


@pytest.mark.parametrize("field", ["text", "answer_start", "is_impossible", "id"])
def test_a_deeply_nested_value_inside_a_record_names_the_record(field):
    record = qa("q-deep")
    if field in ("text", "answer_start"):
        record["answers"][0][field] = nested(100_000)
    else:
        record[field] = nested(100_000)
    with pytest.raises(DataError) as info:
        parse_squad(doc([qa("q1"), record]), "deep.json")
    message = str(info.value)
    assert "deep.json" in message and "data[0].paragraphs[0].qas[1]" in message
    assert len(message) < 400


def test_a_deeply_nested_record_is_skipped_and_counted_with_skip_malformed():
    record = qa("q-deep")
    record["answers"] = nested(100_000)
    examples, skipped = parse_squad(doc([qa("q1"), record, qa("q2")]), "deep.json", skip_malformed=True)
    assert [e.id for e in examples] == ["q1", "q2"] and skipped == 1


def test_an_integer_literal_longer_than_pythons_limit_is_a_data_error_naming_the_file(tmp_path):
    text = json.dumps(doc([qa("q1")])).replace('"answer_start": 0', '"answer_start": ' + "1" * 5000)
    assert "1" * 5000 in text
    assert "huge.json" in data_error(write_text(tmp_path, text, "huge.json"))


# 12b: a lone UTF-16 surrogate escape is not text


def surrogate_file(tmp_path: Path, where: str) -> str:
    """A file whose `where` (question, context or id) holds the JSON escape \\ud800 (an answer is in its
    context, so a surrogate there is one in the context)."""
    mark = "@@"  # replaced by the escape after json.dumps, which would not write a lone surrogate escape
    bad = qa(
        "q-bad" + mark * (where == "id"),
        question="What is it?" + mark * (where == "question"),
    )
    context = CONTEXT + mark * (where == "context")
    text = json.dumps(doc([bad, qa("q-ok")], context=context))
    return write_text(tmp_path, text.replace(mark, "\\ud800"), "surrogate.json")


@pytest.mark.parametrize("where", ["question", "context", "id"])
def test_a_lone_surrogate_is_a_data_error_naming_file_and_record(tmp_path, where):
    message = data_error(surrogate_file(tmp_path, where))
    assert "surrogate.json" in message
    assert "data[0].paragraphs[0]" in message
    if where != "context":
        assert "qas[0]" in message and "q-bad" in message


@pytest.mark.parametrize("where", ["question", "id"])
def test_a_record_with_a_lone_surrogate_is_skipped_and_counted_with_skip_malformed(tmp_path, where):
    examples, skipped = read_squad(surrogate_file(tmp_path, where), skip_malformed=True)
    assert [e.id for e in examples] == ["q-ok"] and skipped == 1
    for example in examples:
        for text in (example.id, example.question, example.context):
            text.encode("utf-8")


def test_an_escaped_surrogate_pair_is_an_ordinary_character(tmp_path):
    text = json.dumps(doc([qa("q1", question="Is \U0001f600 a capital?")]), ensure_ascii=True)
    assert "\\ud83d\\ude00" in text
    (example,) = read_squad(write_text(tmp_path, text))[0]
    assert example.question == "Is \U0001f600 a capital?"


@pytest.mark.parametrize("tokenizer", [WordTokenizer(4096), ByteTokenizer()], ids=["word", "byte"])
def test_tokenizers_accept_a_lone_surrogate_from_outside_a_file(tokenizer):
    ids, spans = tokenizer.encode("where \ud800 is it")
    assert len(ids) == len(spans) and (6, 7) in spans


# 12c: positions and ids fit their dtypes for every length the config accepts


def test_an_answer_past_token_32767_keeps_its_exact_position():
    words = [f"w{i}" for i in range(33_000)]
    context = " ".join(words)
    answer = "w32900"
    example = QAExample("q", "which ?", context, (Answer(answer, context.index(answer)),))
    features = build_features([example], WordTokenizer(4096), 40_000, 24, 32)
    start, end = int(features.start_positions[0]), int(features.end_positions[0])
    assert start == end == 1 + 2 + 1 + 32_900  # [CLS] which ? [SEP] w0 ... w32900
    begin, finish = features.offsets[0, start]
    assert context[begin:finish] == answer


@pytest.mark.parametrize(
    "override",
    ["data.vocab_size=4294967296", "data.max_seq_len=2147483648", "data.max_answer_len=" + "9" * 30],
)
def test_sizes_past_the_int32_cache_columns_are_config_errors_naming_the_field(override):
    field = override.split("=")[0].split(".")[1]
    with pytest.raises(ConfigError, match=field):
        load_config(packaged_config("tiny"), [override])


def test_the_largest_accepted_vocabulary_gives_ids_that_fit_int32():
    tokenizer = WordTokenizer(2**31 - 1)
    ids = [tokenizer.encode(f"word{i}")[0][0] for i in range(2000)]
    assert max(ids) > 2**16 and np.asarray(ids, dtype=np.int32).tolist() == ids


# 12d: a UTF-8 byte order mark


def test_a_utf8_bom_at_the_start_of_the_file_is_accepted(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc([qa("q1")])), encoding="utf-8")
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_squad(str(bom)) == read_squad(str(plain))


# 12e: duplicate question ids


def test_a_duplicate_id_is_a_data_error_naming_the_id_and_both_places(tmp_path):
    path = write_text(tmp_path, json.dumps(doc([qa("q1"), qa("q7")], [qa("q2"), qa("q7")])), "dup.json")
    message = data_error(path)
    assert "dup.json" in message and "q7" in message
    assert "data[0].paragraphs[0].qas[1]" in message  # first
    assert "data[0].paragraphs[1].qas[1]" in message  # second


def test_skip_malformed_keeps_the_first_of_duplicate_ids_and_counts_the_rest(tmp_path):
    first = qa("q7", question="First?")
    text = json.dumps(doc([qa("q1"), first], [qa("q7", question="Second?"), qa("q2"), qa("q7")]))
    examples, skipped = read_squad(write_text(tmp_path, text), skip_malformed=True)
    assert [(e.id, e.question) for e in examples] == [("q1", "What is the capital?"), ("q7", "First?"),
                                                      ("q2", "What is the capital?")]  # fmt: skip
    assert skipped == 2


def test_a_malformed_first_occurrence_leaves_the_id_to_the_valid_second_one(tmp_path):
    broken = {"id": "q7", "question": "   "}
    text = json.dumps(doc([qa("q1"), broken, qa("q7")]))
    examples, skipped = read_squad(write_text(tmp_path, text), skip_malformed=True)
    assert [e.id for e in examples] == ["q1", "q7"] and skipped == 1


# The rest of the adversarial list: each one line, naming the file (and the record where there is one)

HOSTILE_FILES = {
    "empty file": "",
    "only whitespace": "  \n ",
    "a list": "[1, 2]",
    "data is a number": '{"data": 5}',
    "data is a string": '{"data": "x"}',
    "an article is a number": '{"data": [5]}',
    "null": "null",
}


@pytest.mark.parametrize("text", list(HOSTILE_FILES.values()), ids=list(HOSTILE_FILES))
def test_a_file_that_is_not_squad_shaped_is_one_line_naming_it(tmp_path, text):
    assert "shape.json" in data_error(write_text(tmp_path, text, "shape.json"))


BAD_RECORDS = {
    "question is a number": {"id": "q-bad", "question": 5, "answers": [{"text": "Paris", "answer_start": 0}]},
    "question is a list": {"id": "q-bad", "question": ["a"], "answers": []},
    "answer_start past the context": qa("q-bad", start=10_000),
    "answer_start far past any index": qa("q-bad", start=10**40),
    "negative answer_start": qa("q-bad", start=-5),
    "answer text not at answer_start": qa("q-bad", answer="France", start=3),
    "answer text is a number": qa("q-bad", answer=5),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("record", list(BAD_RECORDS.values()), ids=list(BAD_RECORDS))
def test_a_bad_record_is_one_line_naming_file_record_and_id(tmp_path, record):
    message = data_error(write_text(tmp_path, json.dumps(doc([qa("q1"), record])), "bad.json"))
    assert "bad.json" in message and "data[0].paragraphs[0].qas[1]" in message and "q-bad" in message


def test_bad_records_are_skipped_and_counted_with_skip_malformed(tmp_path):
    text = json.dumps(doc([qa("q1"), *BAD_RECORDS.values(), qa("q2")]))
    examples, skipped = read_squad(write_text(tmp_path, text), skip_malformed=True)
    assert [e.id for e in examples] == ["q1", "q2"] and skipped == len(BAD_RECORDS)


def test_a_non_string_context_is_one_line_naming_the_paragraph(tmp_path):
    text = json.dumps(doc([qa("q1")], context=["Paris"]))  # type: ignore[arg-type]
    assert "data[0].paragraphs[0]" in data_error(write_text(tmp_path, text))


def test_an_id_with_a_newline_or_a_huge_value_still_gives_one_short_line(tmp_path):
    record = {"id": "q\nbad", "question": "What?", "answers": [{"text": "x" * 100_000, "answer_start": 0}]}
    message = data_error(write_text(tmp_path, json.dumps(doc([qa("q1"), record]))))
    assert "q\\nbad" in message


def test_an_article_without_paragraphs_is_skipped_and_counted_with_skip_malformed(tmp_path):
    text = json.dumps({"data": [{"title": "bad"}, *doc([qa("q1")])["data"], 7]})
    examples, skipped = read_squad(write_text(tmp_path, text), skip_malformed=True)
    assert [e.id for e in examples] == ["q1"] and skipped == 2
