"""Tabular sources: Parquet, Arrow (stream and file format), `datasets` save_to_disk directories and hub
datasets, read as SQuAD-schema rows, streamed by record batch, each malformed row named with its file."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from elastic_qa.config import DataConfig, load_config, packaged_config  # noqa: E402
from elastic_qa.data.examples import DataError  # noqa: E402
from elastic_qa.observe.follow import read_events  # noqa: E402
from elastic_qa.prep import (  # noqa: E402
    cache_key,
    prepare,
    sources,
)
from elastic_qa.prep.sources import read_squad  # noqa: E402
from elastic_qa.prep.synthetic import write_squad_file  # noqa: E402
from elastic_qa.prep.tables import ipc_rows  # noqa: E402
from tests.conftest import train_tiny  # noqa: E402

CONTEXT = "Paris is the capital of France."
QUESTIONS = 2000  # 8 chunks: more than a build does inline before it starts helper processes


def row(qid: str, **changes) -> dict:
    return {
        "id": qid,
        "title": "France",
        "context": CONTEXT,
        "question": "What is the capital?",
        "answers": {"text": ["Paris"], "answer_start": [0]},
        **changes,
    }


def json_line(qid: str) -> str:
    answers = [{"text": "Paris", "answer_start": 0}]
    return json.dumps({"id": qid, "question": "Which city?", "context": CONTEXT, "answers": answers}) + "\n"


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Path, Path]:
    """The same generated questions as JSON Lines and as Parquet (row groups of 300 rows)."""
    root = tmp_path_factory.mktemp("generated")
    write_squad_file(str(root / "train.jsonl"), QUESTIONS, seed=4)
    write_squad_file(str(root / "whole.parquet"), QUESTIONS, seed=4)
    pq.write_table(pq.read_table(root / "whole.parquet"), root / "train.parquet", row_group_size=300)
    return root / "train.jsonl", root / "train.parquet"


def test_a_generated_parquet_file_gives_the_same_examples_as_json_lines(generated):
    lines, parquet = generated
    from_lines, from_parquet = read_squad(str(lines))[0], read_squad(str(parquet))[0]
    assert len(from_parquet) == QUESTIONS and from_parquet == from_lines
    assert any(not e.answers for e in from_parquet) and any(e.answers for e in from_parquet)


def test_a_parquet_file_is_read_a_chunk_of_rows_at_a_time(generated):
    _, parquet = generated
    step = sources.CHUNK_LINES
    sizes = [(c.records[0][0], len(ipc_rows(c.records[0][1]))) for c in sources.chunks(str(parquet))]
    assert sizes == [(first, min(step, QUESTIONS - first)) for first in range(0, QUESTIONS, step)]


def test_the_chunks_of_a_saved_dataset_carry_only_their_own_rows_to_a_worker(tmp_path, generated):
    _, parquet = generated
    datasets.Dataset.from_parquet(str(parquet)).save_to_disk(str(tmp_path / "saved"))  # 1,000-row batches
    (arrow,) = sources.source_urls(str(tmp_path / "saved"))
    sent = sum(len(pickle.dumps(chunk)) for chunk in sources.chunks(arrow))
    assert sent < 1.2 * Path(arrow).stat().st_size  # a pickled slice of a batch would carry the whole batch


@pytest.mark.parametrize("kind", ["arrow stream", "arrow file", "feather"])
def test_arrow_files_in_either_ipc_format_give_the_same_examples(tmp_path, generated, kind):
    lines, parquet = generated
    table = pq.read_table(parquet)
    path = tmp_path / ("train.feather" if kind == "feather" else "train.arrow")
    new = pa.ipc.new_stream if kind == "arrow stream" else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    assert read_squad(str(path))[0] == read_squad(str(lines))[0]


def test_a_saved_dataset_and_a_split_of_a_saved_dataset_dict_are_sources(tmp_path, generated):
    lines, parquet = generated
    train = datasets.Dataset.from_parquet(str(parquet))
    evaluation = datasets.Dataset.from_list([row("e1"), row("e2", answers={"text": [], "answer_start": []})])
    train.save_to_disk(str(tmp_path / "one"), num_shards=2)
    datasets.DatasetDict(train=train, validation=evaluation).save_to_disk(str(tmp_path / "dict"))
    expected = read_squad(str(lines))[0]
    assert read_squad(str(tmp_path / "one"))[0] == expected
    assert read_squad(f"{tmp_path / 'dict'}:train")[0] == expected
    held_out = read_squad(f"{tmp_path / 'dict'}:validation")[0]
    assert [(e.id, e.is_impossible) for e in held_out] == [("e1", False), ("e2", True)]
    with pytest.raises(DataError, match=r"DatasetDict directory \(splits: train, validation\): name one"):
        read_squad(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"no split 'test' \(splits: train, validation\)"):
        read_squad(f"{tmp_path / 'dict'}:test")


def test_a_glob_of_parquet_files_mixes_with_json_lines_in_order(tmp_path):
    write_parquet(tmp_path / "part-2.parquet", [row("q3"), row("q4")])
    write_parquet(tmp_path / "part-1.parquet", [row("q1"), row("q2")])
    (tmp_path / "extra.jsonl").write_text(json_line("q5"))
    examples = read_squad(f"{tmp_path / 'part-*.parquet'}, {tmp_path / 'extra.jsonl'}")[0]
    assert [e.id for e in examples] == ["q1", "q2", "q3", "q4", "q5"]


def test_answers_as_a_list_of_structs_and_an_is_impossible_column_are_read(tmp_path):
    path = write_parquet(
        tmp_path / "structs.parquet",
        [
            {**row("q1"), "answers": [{"text": "Paris", "answer_start": 0}], "is_impossible": False},
            {**row("q2"), "answers": [], "is_impossible": True},
        ],
    )
    examples = read_squad(str(path))[0]
    assert [(e.id, [a.text for a in e.answers]) for e in examples] == [("q1", ["Paris"]), ("q2", [])]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"answers": {"text": ["Rome"], "answer_start": [0]}}, "is not at answer_start"),
        ({"answers": {"text": ["Paris"], "answer_start": [400]}}, "is not at answer_start=400"),
        ({"answers": {"text": ["Paris", "Paris"], "answer_start": [0]}}, "of one length"),
        ({"question": ""}, "'question'"),
        ({"context": None}, "'context' must be a non-empty string"),
    ],
    ids=[
        "answer not in context",
        "answer_start out of range",
        "ragged answers",
        "no question",
        "null context",
    ],
)
def test_a_malformed_row_is_a_data_error_naming_file_row_and_id(tmp_path, bad, says):
    path = write_parquet(tmp_path / "train.parquet", [row("q0"), row("q1"), row("q2", **bad), row("q3")])
    with pytest.raises(DataError) as info:
        read_squad(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: row 2 (id q2): ") and says in message and "\n" not in message


def test_a_missing_column_is_named_with_the_columns_the_file_has(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [{k: v for k, v in row("q0").items() if k != "context"}])
    with pytest.raises(
        DataError, match=r"row 0 \(id q0\): no 'context' column \(columns: id, title, question"
    ):
        read_squad(str(path))


def test_a_column_of_the_wrong_type_is_a_data_error(tmp_path):
    path = write_parquet(
        tmp_path / "train.parquet", [row("q0", answers=[{"text": "Paris", "answer_start": 0.0}])]
    )
    with pytest.raises(DataError, match=r"row 0 \(id q0\): answer needs .* an integer 'answer_start'"):
        read_squad(str(path))


def test_malformed_rows_and_a_duplicate_id_are_skipped_and_counted_with_skip_malformed(tmp_path):
    path = write_parquet(
        tmp_path / "train.parquet",
        [row("q1"), row("q2", context="Rome."), row("q1"), row("q3")],
    )
    examples, skipped = read_squad(str(path), skip_malformed=True)
    assert [e.id for e in examples] == ["q1", "q3"] and skipped == 2


def test_a_duplicate_id_across_a_parquet_and_a_json_lines_file_names_both(tmp_path):
    first = write_parquet(tmp_path / "a.parquet", [row("q1"), row("q2")])
    second = tmp_path / "b.jsonl"
    second.write_text(json_line("q2"))
    with pytest.raises(DataError) as info:
        read_squad(f"{first},{second}")
    assert str(info.value).startswith(f"{second}: line 1 (id q2): duplicate id, first at {first}: row 1")


def test_a_file_that_is_not_parquet_is_a_data_error_naming_it(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("id,question\n")
    with pytest.raises(DataError, match=rf"{path}: not a readable Parquet file after row 0"):
        read_squad(str(path))


def test_without_pyarrow_a_parquet_source_names_the_extra_to_install(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "train.parquet", [row("q1")])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # what `import` finds for an absent module
    with pytest.raises(DataError, match=r"needs pyarrow \(pip install 'elastic-qa\[datasets\]'\)"):
        read_squad(str(path))


def data_config(tmp_path: Path, cache: str, **changes) -> DataConfig:
    base = load_config(packaged_config("tiny")).data
    return dataclasses.replace(base, cache_dir=str(tmp_path / cache), **changes)


def columns_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*.npy"))}


def test_the_cache_from_parquet_holds_the_same_features_as_from_the_same_json_lines(tmp_path, generated):
    lines, parquet = generated
    from_lines = prepare(data_config(tmp_path, "a", source=str(lines), eval_source=str(lines)), workers=1)
    from_parquet = prepare(
        data_config(tmp_path, "b", source=str(parquet), eval_source=str(parquet)), workers=2
    )
    assert from_parquet.key != from_lines.key  # the inputs' digests differ
    assert columns_of(from_parquet.path) == columns_of(from_lines.path)
    assert len(columns_of(from_parquet.path)["train/input_ids.npy"]) > 10_000
    assert list(from_parquet.eval_examples) == read_squad(str(lines))[0]


@pytest.mark.long
def test_a_tiny_run_trains_and_evaluates_on_parquet_sources(tmp_path, generated):
    _, parquet = generated
    write_squad_file(str(tmp_path / "dev.parquet"), 100, seed=9)
    run_dir = tmp_path / "run"
    sources_ = (f"data.source={parquet}", f"data.eval_source={tmp_path / 'dev.parquet'}")
    train_tiny(run_dir, tmp_path / "cache", *sources_, "train.max_steps=10", "train.eval_every=10")
    evaluations = [e for e in read_events(run_dir) if e["event"] == "eval"]
    assert [(e["step"], e["questions"]) for e in evaluations] == [(10, 100)]


def test_the_key_of_a_saved_dataset_follows_its_arrow_files(tmp_path):
    datasets.Dataset.from_list([row("q1")]).save_to_disk(str(tmp_path / "saved"))
    before = cache_key(data_config(tmp_path, "cache", source=str(tmp_path / "saved")))
    datasets.Dataset.from_list([row("q1", question="Which city?")]).save_to_disk(str(tmp_path / "saved"))
    assert cache_key(data_config(tmp_path, "cache", source=str(tmp_path / "saved"))) != before


def test_a_hub_source_naming_a_local_directory_streams_it_through_load_dataset(tmp_path):
    (tmp_path / "hubcopy" / "data").mkdir(parents=True)
    rows = [row("q1"), row("q2", answers={"text": [], "answer_start": []}), row("q3")]
    path = write_parquet(tmp_path / "hubcopy" / "data" / "train-00000.parquet", rows)
    source = f"hub:{tmp_path / 'hubcopy'}:train"
    assert read_squad(source)[0] == read_squad(str(path))[0]
    key = cache_key(data_config(tmp_path, "cache", source=source))
    write_parquet(path, rows[:2])
    assert cache_key(data_config(tmp_path, "cache", source=source)) != key


def test_an_unreachable_hub_is_one_line_naming_the_dataset_and_the_local_copy_way_exit_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the hub is unreachable whatever the network allows
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", "prepare", "--config", "tiny", f"data.cache_dir={tmp_path}",
         "data.source=hub:rajpurkar/squad_v2:squad_v2:train"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    error = result.stderr.strip()
    assert error.startswith("elastic-qa: hub:rajpurkar/squad_v2:squad_v2:train: could not load it from the")
    assert "save_to_disk(DIR)" in error and "\n" not in error


@pytest.mark.parametrize("entry", ["hub:squad_v2", "hub:a:b:c:d", "hub::train"])
def test_a_hub_entry_without_a_split_is_a_data_error_showing_the_syntax(entry):
    with pytest.raises(DataError, match=r"expected hub:DATASET:SPLIT or hub:DATASET:CONFIG:SPLIT"):
        read_squad(entry)
