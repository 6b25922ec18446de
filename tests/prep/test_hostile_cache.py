"""A hostile input or an interrupted build leaves no half-built cache, and the worker and `prepare` exit 2
with one line naming the file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.config import DataConfig, load_config, packaged_config
from elastic_qa.data.examples import DataError
from elastic_qa.prep import cache, cache_key, prepare
from elastic_qa.prep.synthetic import generate
from tests.conftest import tiny_overrides

CONTEXT = "Paris is the capital of France."


def qa(qid: str, question: str = "What is the capital?") -> dict:
    return {"id": qid, "question": question, "answers": [{"text": "Paris", "answer_start": 0}]}


def squad_text(*qas: dict) -> str:
    return json.dumps({"data": [{"paragraphs": [{"context": CONTEXT, "qas": list(qas)}]}]})


HOSTILE = {
    "nested 100k deep": '{"data": [' + "[" * 100_000 + "]" * 100_000 + "]}",
    "lone surrogate": squad_text(qa("q1"), qa("q2", "What @@ is it?")).replace("@@", "\\ud800"),
    "duplicate id": squad_text(qa("q1"), qa("q2"), qa("q1")),
}


def write(tmp_path: Path, text: str, name: str = "hostile.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def data_config(tmp_path: Path, **changes) -> DataConfig:
    base = load_config(packaged_config("tiny")).data
    return dataclasses.replace(base, cache_dir=str(tmp_path / "cache"), **changes)


def leftovers(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.glob("*.tmp-*")) if cache_dir.exists() else []


def test_a_surrogate_record_is_skipped_and_counted_and_the_cache_builds(tmp_path):
    source = write(tmp_path, HOSTILE["lone surrogate"])
    data = prepare(data_config(tmp_path, source=str(source), skip_malformed=True))
    assert data.skipped == {"train": 1}
    assert sorted(set(data.train.example_index.tolist())) == [0]
    assert leftovers(tmp_path / "cache") == []


def test_a_later_duplicate_id_is_skipped_and_counted_by_prepare_with_skip_malformed(tmp_path):
    source = write(tmp_path, HOSTILE["duplicate id"])
    data = prepare(data_config(tmp_path, source=str(source), skip_malformed=True))
    assert sorted(set(data.train.example_index.tolist())) == [0, 1]
    assert data.skipped == {"train": 1}


def test_a_duplicate_id_in_the_eval_source_is_refused_by_prepare(tmp_path):
    train = write(tmp_path, squad_text(qa("q1")), "train.json")
    dev = write(tmp_path, HOSTILE["duplicate id"], "dev.json")
    with pytest.raises(DataError, match=r"dev\.json.*q1"):
        prepare(data_config(tmp_path, source=str(train), eval_source=str(dev)))


def test_the_synthetic_generator_never_repeats_an_id():
    for split in ("train", "eval"):
        ids = [e.id for e in generate(split, 2000, 3, 0.15)]
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("interrupt", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_interrupted_build_takes_its_staging_directory_along(tmp_path, monkeypatch, interrupt):
    def fail(*_args):  # the fault arrives in the middle of the build, after staging exists
        assert leftovers(tmp_path / "cache"), "the staging directory should exist by now"
        raise interrupt

    monkeypatch.setattr(cache, "build_split", fail)
    with pytest.raises(type(interrupt)):
        prepare(data_config(tmp_path))
    assert leftovers(tmp_path / "cache") == []


def test_a_staging_directory_left_by_a_killed_builder_is_removed_by_the_next_build(tmp_path):
    cfg = data_config(tmp_path)
    (tmp_path / "cache").mkdir()
    stale = tmp_path / "cache" / f"{cache_key(cfg)}.tmp-99999999"
    (stale / "train").mkdir(parents=True)
    prepare(cfg)
    assert leftovers(tmp_path / "cache") == []


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_worker_exits_2_with_one_line_naming_a_hostile_file(tmp_path, name):
    source = write(tmp_path, HOSTILE[name])
    cache_dir = tmp_path / "cache"
    result = run_module(
        "elastic_qa.train",
        "--config",
        "tiny",
        *tiny_overrides(tmp_path / "run", cache_dir, f"data.source={source}", "data.eval_source="),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    # The worker's logger also echoes its `bad_input` error event to stderr; the message is one line.
    said = [line for line in result.stderr.splitlines() if line.startswith("elastic-qa:")]
    assert len(said) == 1 and str(source) in said[0], result.stderr[-2000:]
    assert leftovers(cache_dir) == []


def test_prepare_exits_2_with_one_line_naming_a_hostile_file(tmp_path):
    source = write(tmp_path, HOSTILE["lone surrogate"])
    cache_dir = tmp_path / "cache"
    result = run_module(
        "elastic_qa.cli",
        "prepare",
        "--config",
        "tiny",
        f"data.source={source}",
        f"data.cache_dir={cache_dir}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(source) in lines[0], result.stderr[-2000:]
    assert leftovers(cache_dir) == []
