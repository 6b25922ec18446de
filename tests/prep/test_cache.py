"""The memory-mapped feature cache: built once, keyed by content and settings, safe under concurrency."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest

from elastic_qa.config import DataConfig, load_config, packaged_config
from elastic_qa.data.cache import VOCAB_FILE
from elastic_qa.data.examples import DataError
from elastic_qa.prep import cache, cache_key, prepare
from elastic_qa.prep.build import EVAL_COLUMNS, TRAIN_COLUMNS
from elastic_qa.prep.sources import read_squad
from elastic_qa.prep.synthetic import generate, iter_examples
from elastic_qa.prep.tokenizer import SEP, UNK, WordTokenizer
from elastic_qa.prep.windows import build_features

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def data_config(cache_dir: Path, **changes) -> DataConfig:
    base = load_config(packaged_config("tiny")).data
    synthetic = dataclasses.replace(base.synthetic, train_examples=120, eval_examples=30)
    return dataclasses.replace(base, cache_dir=str(cache_dir), synthetic=synthetic, **changes)


def npy_mtimes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*.npy"))}


def squad_file(tmp_path: Path, name: str, answer_city: str = "Warsaw") -> Path:
    doc = json.loads((FIXTURES / "squad-v2-handwritten.json").read_text())
    paragraph = doc["data"][0]["paragraphs"][0]
    paragraph["context"] = paragraph["context"].replace("Warsaw", answer_city)
    paragraph["qas"][0]["answers"][0]["text"] = answer_city
    path = tmp_path / name
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return path


def test_prepare_builds_once_and_then_reuses_the_same_files(tmp_path, monkeypatch):
    cfg = data_config(tmp_path / "cache")
    first = prepare(cfg)
    before = npy_mtimes(first.path)
    # train and eval columns (offsets for eval only) and the eval examples' index
    assert len(before) == len(TRAIN_COLUMNS) + len(EVAL_COLUMNS) + 1

    def no_rebuild(*_args):
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr(cache, "_build", no_rebuild)
    time.sleep(0.01)
    second = prepare(cfg)
    assert second.path == first.path
    assert second.key == first.key == first.path.name
    assert npy_mtimes(second.path) == before


def test_the_cached_features_equal_freshly_built_ones(tmp_path):
    cfg = data_config(tmp_path)
    data = prepare(cfg)
    tokenizer = WordTokenizer(cfg.vocab_size, cfg.lowercase)
    for split, count, prepared in (("train", 120, data.train), ("eval", 30, data.eval)):
        examples = generate(split, count, cfg.synthetic.seed, cfg.synthetic.unanswerable_fraction)
        fresh = build_features(examples, tokenizer, cfg.max_seq_len, cfg.max_query_len, cfg.doc_stride)
        for column in TRAIN_COLUMNS if split == "train" else EVAL_COLUMNS:
            np.testing.assert_array_equal(getattr(prepared, column), getattr(fresh, column))
    assert data.train.offsets is None  # training never reads them
    assert data.eval_examples == generate("eval", 30, cfg.synthetic.seed, cfg.synthetic.unanswerable_fraction)
    assert data.vocab_size == cfg.vocab_size


def test_cached_columns_are_read_only_memory_maps(tmp_path):
    data = prepare(data_config(tmp_path))
    for features, columns in ((data.train, TRAIN_COLUMNS), (data.eval, EVAL_COLUMNS)):
        for column in columns:
            array = getattr(features, column)
            assert isinstance(array, np.memmap), column
            assert not array.flags.writeable


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": "byte"},
        {"vocab_size": 2048},
        {"lowercase": False},
        {"max_seq_len": 96},
        {"max_query_len": 16},
        {"doc_stride": 16},
    ],
    ids=lambda change: next(iter(change)),
)
def test_the_key_changes_with_every_tokenizer_and_window_setting(tmp_path, change):
    assert cache_key(data_config(tmp_path, **change)) != cache_key(data_config(tmp_path))


def test_the_key_changes_with_the_synthetic_generator_settings(tmp_path):
    base = data_config(tmp_path)
    for change in (
        {"seed": 8},
        {"train_examples": 121},
        {"eval_examples": 31},
        {"unanswerable_fraction": 0.2},
    ):
        other = dataclasses.replace(base, synthetic=dataclasses.replace(base.synthetic, **change))
        assert cache_key(other) != cache_key(base), change


def test_the_key_ignores_settings_that_do_not_change_the_features(tmp_path):
    base = data_config(tmp_path / "a")
    same = dataclasses.replace(base, cache_dir=str(tmp_path / "b"), num_workers=3, max_answer_len=5)
    assert cache_key(same) == cache_key(base)
    byte = data_config(tmp_path, tokenizer="byte")
    assert cache_key(dataclasses.replace(byte, vocab_size=2048, lowercase=False)) == cache_key(byte)


def test_the_key_follows_the_content_of_a_squad_file_not_its_name(tmp_path):
    path = squad_file(tmp_path, "train.json")
    cfg = data_config(tmp_path, source=str(path))
    key = cache_key(cfg)
    copy = squad_file(tmp_path, "copy.json")
    assert cache_key(dataclasses.replace(cfg, source=str(copy))) == key
    squad_file(tmp_path, "train.json", answer_city="Krakow")
    assert cache_key(cfg) != key


def test_the_key_follows_the_content_of_the_eval_file(tmp_path):
    train, dev = squad_file(tmp_path, "train.json"), squad_file(tmp_path, "dev.json")
    cfg = data_config(tmp_path, source=str(train), eval_source=str(dev))
    key = cache_key(cfg)
    assert key != cache_key(dataclasses.replace(cfg, eval_source=""))
    squad_file(tmp_path, "dev.json", answer_city="Lodz")
    assert cache_key(cfg) != key


def test_a_squad_source_is_cached_with_its_eval_examples(tmp_path):
    train, dev = squad_file(tmp_path, "train.json"), FIXTURES / "squad-v2-dev-sample.json"
    data = prepare(data_config(tmp_path / "cache", source=str(train), eval_source=str(dev)))
    assert sorted(set(data.train.example_index.tolist())) == [0, 1, 2, 3]
    assert data.eval is not None
    assert data.eval_examples == read_squad(str(dev))[0]
    assert sorted(set(data.eval.example_index.tolist())) == list(range(14))


def test_a_squad_source_without_eval_file_has_no_eval_split(tmp_path):
    data = prepare(data_config(tmp_path / "cache", source=str(squad_file(tmp_path, "train.json"))))
    assert data.eval is None
    assert len(data.eval_examples) == 0


def test_a_missing_squad_source_is_a_data_error_and_leaves_no_cache(tmp_path):
    cfg = data_config(tmp_path / "cache", source=str(tmp_path / "absent.json"))
    with pytest.raises(DataError, match=r"absent\.json"):
        prepare(cfg)
    root = tmp_path / "cache"
    assert (list(root.iterdir()) if root.exists() else []) == []


def _prepare_in_child(cfg: DataConfig, barrier, results) -> None:
    barrier.wait(timeout=30)
    data = prepare(cfg)
    complete = all(len(getattr(data.train, c)) == len(data.train) for c in TRAIN_COLUMNS)
    results.put((str(data.path), len(data.train), len(data.eval), complete))


def test_concurrent_prepares_share_one_build_and_both_get_a_complete_cache(tmp_path, monkeypatch):
    cfg = data_config(tmp_path / "cache")
    builds = tmp_path / "builds.log"
    real_build = cache._build

    def slow_counted_build(*args):
        with open(builds, "a") as handle:
            handle.write("build\n")
        time.sleep(0.3)  # both processes are inside prepare() while the first one builds
        real_build(*args)

    monkeypatch.setattr(cache, "_build", slow_counted_build)  # inherited by the forked children
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    children = [context.Process(target=_prepare_in_child, args=(cfg, barrier, results)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
    assert [child.exitcode for child in children] == [0, 0]
    outcomes = [results.get(timeout=5) for _ in children]  # a few bytes each: joining first cannot block
    assert builds.read_text().splitlines() == ["build"]
    paths = {path for path, *_ in outcomes}
    assert len(paths) == 1
    assert all(train == 120 and held_out == 30 and complete for _, train, held_out, complete in outcomes)
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    key = Path(paths.pop()).name
    assert entries == [key, f"{key}.lock"]  # one cache directory, no leftover .tmp- staging
    assert not any(".tmp-" in p.name for p in (tmp_path / "cache").rglob("*"))


@pytest.mark.parametrize(
    "damage",
    ["truncate a column", "delete a column", "corrupt meta.json", "delete meta.json"],
)
def test_a_damaged_cache_is_a_data_error_naming_its_directory(tmp_path, damage):
    cfg = data_config(tmp_path / "cache")
    path = prepare(cfg).path
    column = path / "train" / "input_ids.npy"
    if damage == "truncate a column":
        column.write_bytes(column.read_bytes()[:200])
    elif damage == "delete a column":
        column.unlink()
    elif damage == "corrupt meta.json":
        (path / "meta.json").write_text("{not json")
    else:
        (path / "meta.json").unlink()
    with pytest.raises(DataError) as info:
        prepare(cfg)
    assert str(path) in str(info.value)
    assert not any(".tmp-" in p.name for p in (tmp_path / "cache").iterdir())


def test_content_hash_reads_an_unchanged_input_once_and_sees_a_change(tmp_path, monkeypatch) -> None:
    import os

    from elastic_qa.prep import cache

    source = tmp_path / "train.json"
    source.write_text('{"data": []}')
    reads = []
    real_read = cache.file_digest
    monkeypatch.setattr(cache, "file_digest", lambda url: reads.append(url) or real_read(url))
    first = cache.content_hash(str(source), tmp_path)
    assert cache.content_hash(str(source), tmp_path) == first
    assert len(reads) == 1  # the restart did not read the file again
    source.write_text('{"data": [ ]}')
    os.utime(source, ns=(1, 1))
    assert cache.content_hash(str(source), tmp_path) != first
    assert len(reads) == 2


def wordpiece_config(tmp_path: Path, **changes) -> DataConfig:
    pytest.importorskip("tokenizers")
    return data_config(tmp_path, tokenizer="wordpiece", vocab_size=500, **changes)


def test_the_wordpiece_key_changes_with_vocab_size_lowercase_and_the_vocab_files_content(tmp_path):
    from elastic_qa.prep import wordpiece

    base = wordpiece_config(tmp_path)
    assert cache_key(dataclasses.replace(base, vocab_size=501)) != cache_key(base)
    assert cache_key(dataclasses.replace(base, lowercase=False)) != cache_key(base)
    assert cache_key(dataclasses.replace(base, tokenizer="word")) != cache_key(base)
    a, b, copy = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "copy-of-a.json"
    a.write_text(wordpiece.train(lambda: ["some text to learn from"] * 10, 300, lowercase=True))
    b.write_text(wordpiece.train(lambda: ["other text to learn from"] * 10, 300, lowercase=True))
    copy.write_bytes(a.read_bytes())
    keys = {name: cache_key(dataclasses.replace(base, vocab_file=str(path))) for name, path in
            (("a", a), ("b", b), ("copy", copy))}  # fmt: skip
    assert keys["a"] == keys["copy"] != keys["b"]
    assert base.vocab_file == "" and keys["a"] != cache_key(base)
    # a given vocabulary decides case and size itself: those settings do not split the cache
    given = dataclasses.replace(base, vocab_file=str(a))
    assert cache_key(dataclasses.replace(given, vocab_size=9000, lowercase=False)) == keys["a"]


def test_a_given_vocab_file_is_the_one_the_windows_use_and_is_stored_with_the_cache(tmp_path):
    from elastic_qa.prep import wordpiece

    given = tmp_path / "tokenizer.json"
    questions = [e.question for e in iter_examples("train", 50, 3, 0.0)]
    given.write_text(wordpiece.train(lambda: questions, 300, lowercase=False))
    data = prepare(wordpiece_config(tmp_path / "cache", vocab_file=str(given)))
    assert data.vocabulary == given.read_text()
    assert (data.path / VOCAB_FILE).read_bytes() == given.read_bytes()
    tokenizer = wordpiece.parse(given.read_bytes(), "given")
    assert data.vocab_size == tokenizer.vocab_size < 300
    example = data.eval_examples[0]
    window = data.eval.input_ids[0].tolist()
    assert window[1 : window.index(SEP)] == tokenizer.encode(example.question)[0]  # [CLS] question [SEP]
    assert set(window[1 : window.index(SEP)]) != {UNK}


def test_a_bad_vocab_file_is_a_config_error_naming_it_and_leaves_no_cache(tmp_path):
    from elastic_qa.config import ConfigError

    root = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"data.vocab_file='.*missing.json': file not found"):
        prepare(wordpiece_config(root, vocab_file=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match=r"data.vocab_file='.*bad.json': not a tokenizer.json"):
        prepare(wordpiece_config(root, vocab_file=str(bad)))
    assert not [p for p in root.iterdir() if p.is_dir()]
