"""Data sources: SQuAD JSON walked incrementally, JSON Lines, several files and globs, each malformed record
named with its file and place."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from elastic_qa.data.examples import DataError
from elastic_qa.prep import stream
from elastic_qa.prep.sources import parse_squad, read_squad
from elastic_qa.prep.stream import JSONStreamError, squad_paragraphs
from elastic_qa.prep.synthetic import write_squad_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CONTEXT = "Paris is the capital of France."


def qa(qid: str, question: str = "What is the capital?") -> dict:
    return {"id": qid, "question": question, "answers": [{"text": "Paris", "answer_start": 0}]}


def line(qid: str, **changes) -> str:
    return json.dumps({"context": CONTEXT, **qa(qid), **changes}) + "\n"


@pytest.mark.parametrize("fixture", ["squad-v2-handwritten.json", "squad-v2-dev-sample.json"])
def test_a_file_read_in_7_byte_pieces_gives_the_same_examples_as_json_loads(fixture, monkeypatch):
    path = FIXTURES / fixture
    whole, _ = parse_squad(json.loads(path.read_text(encoding="utf-8")), str(path))
    monkeypatch.setattr(stream, "CHUNK", 7)  # every value crosses piece boundaries
    assert read_squad(str(path))[0] == whole


def test_an_error_deep_in_a_file_read_in_pieces_names_line_and_column_as_json_loads_does(monkeypatch):
    good = json.dumps({"data": [{"paragraphs": [{"context": CONTEXT, "qas": [qa("q1")]}]}]}, indent=1)
    broken = good.replace('"q1"', '"q1" "x"')
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(broken)
    monkeypatch.setattr(stream, "CHUNK", 5)
    with pytest.raises(JSONStreamError) as got:
        list(squad_paragraphs(io.BytesIO(broken.encode())))
    assert f"line {expected.value.lineno}, column {expected.value.colno}" in str(got.value)


def test_a_generated_file_in_json_and_json_lines_gives_the_same_examples(tmp_path):
    write_squad_file(str(tmp_path / "a.json"), 100, seed=3)
    write_squad_file(str(tmp_path / "a.jsonl"), 100, seed=3)
    from_json, from_lines = read_squad(str(tmp_path / "a.json"))[0], read_squad(str(tmp_path / "a.jsonl"))[0]
    assert len(from_json) == 100 and from_json == from_lines
    assert any(not e.answers for e in from_json) and any(e.answers for e in from_json)


def test_several_files_and_a_glob_read_as_one_source_in_order(tmp_path):
    (tmp_path / "part-1.jsonl").write_text(line("q1") + line("q2"))
    (tmp_path / "part-2.jsonl").write_text(line("q3"))
    squad = {"data": [{"paragraphs": [{"context": CONTEXT, "qas": [qa("q4")]}]}]}
    (tmp_path / "extra.json").write_text(json.dumps(squad))
    listed = read_squad(f"{tmp_path / 'part-1.jsonl'},{tmp_path / 'part-2.jsonl'}, {tmp_path / 'extra.json'}")
    globbed = read_squad(f"{tmp_path / 'part-*.jsonl'},{tmp_path / 'extra.json'}")
    assert [e.id for e in listed[0]] == [e.id for e in globbed[0]] == ["q1", "q2", "q3", "q4"]


def test_a_glob_that_matches_nothing_is_a_data_error_naming_it(tmp_path):
    with pytest.raises(DataError, match=r"none-\*\.json: no file matches"):
        read_squad(str(tmp_path / "none-*.json"))


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("{not json\n", "not valid JSON"),
        (line("q3", answers=[{"text": "Rome", "answer_start": 0}]), "is not at answer_start"),
        (json.dumps({"id": "q3", "question": "Why?"}) + "\n", "'context'"),
        ("[1, 2]\n", "'context'"),
    ],
    ids=["not json", "answer not in context", "no context", "not an object"],
)
def test_a_malformed_json_line_is_a_data_error_naming_file_and_line(tmp_path, bad, says):
    path = tmp_path / "train.jsonl"
    path.write_text(line("q1") + "\n" + bad + line("q4"))
    with pytest.raises(DataError) as info:
        read_squad(str(path))
    message = str(info.value)
    assert f"{path}: line 3" in message and says in message and "\n" not in message


def test_malformed_json_lines_are_skipped_and_counted_with_skip_malformed(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(line("q1") + "{not json\n" + line("q1") + line("q2"))
    examples, skipped = read_squad(str(path), skip_malformed=True)
    assert [e.id for e in examples] == ["q1", "q2"] and skipped == 2  # the broken line and the duplicate


def test_a_duplicate_id_in_another_file_names_both_files(tmp_path):
    (tmp_path / "a.jsonl").write_text(line("q1") + line("q2"))
    (tmp_path / "b.jsonl").write_text(line("q3") + line("q2"))
    with pytest.raises(DataError) as info:
        read_squad(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'b.jsonl'}: line 2 (id q2): duplicate id")
    assert f"first at {tmp_path / 'a.jsonl'}: line 2" in message


def test_a_truncated_file_is_an_error_after_the_records_before_it(tmp_path):
    text = json.dumps({"data": [{"paragraphs": [{"context": CONTEXT, "qas": [qa("q1"), qa("q2")]}]}]})
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 5])
    with pytest.raises(DataError, match=r"cut\.json: not valid JSON \(line 1, column \d+"):
        read_squad(str(path))
