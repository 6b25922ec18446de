"""The streamed, parallel cache build: the same bytes whatever the number of workers, memory bounded by a
chunk rather than the input, one builder among concurrent ones (also where flock does nothing)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from elastic_qa.config import Config, DataConfig, load_config, packaged_config
from elastic_qa.data.cache import VOCAB_FILE, StoredExamples
from elastic_qa.prep import build, cache_key, lease, prepare, stream
from elastic_qa.prep.sources import read_squad
from elastic_qa.prep.synthetic import write_squad_file

REPO = Path(__file__).resolve().parents[2]


def data_config(tmp_path: Path, cache: str = "cache", **changes) -> DataConfig:
    base = load_config(packaged_config("tiny")).data
    return dataclasses.replace(base, cache_dir=str(tmp_path / cache), **changes)


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """3,000 training questions (about a dozen chunks) and 500 held-out ones."""
    root = tmp_path_factory.mktemp("inputs")
    write_squad_file(str(root / "train.json"), 3000, seed=5)
    write_squad_file(str(root / "dev.jsonl"), 500, seed=6)
    return root / "train.json", root / "dev.jsonl"


def test_one_two_and_three_workers_build_byte_identical_caches_under_one_key(tmp_path, inputs):
    train, dev = inputs
    built = {}
    for workers in (1, 2, 3):
        cfg = data_config(tmp_path, f"cache-{workers}", source=str(train), eval_source=str(dev))
        data = prepare(cfg, workers=workers)
        built[workers] = (data.key, files_of(data.path))
    assert built[1][0] == built[2][0] == built[3][0]
    assert built[1][1] == built[2][1] == built[3][1]
    assert len(built[1][1]["train/input_ids.npy"]) > 100_000  # more chunks than are done inline


def test_a_wordpiece_cache_trains_its_vocabulary_once_the_same_with_one_or_two_workers(tmp_path, inputs):
    pytest.importorskip("tokenizers")
    from elastic_qa.prep import wordpiece

    train, dev = inputs
    built = {}
    for workers in (1, 2):
        cfg = data_config(
            tmp_path, f"cache-{workers}", source=str(train), eval_source=str(dev), tokenizer="wordpiece",
            vocab_size=2000,
        )  # fmt: skip
        data = prepare(cfg, workers=workers)
        built[workers] = (data.key, files_of(data.path))
    assert built[1] == built[2]
    vocabulary = built[1][1][VOCAB_FILE]
    assert data.vocabulary == vocabulary.decode()
    tokenizer = wordpiece.parse(vocabulary, "the cache's")
    assert json.loads(built[1][1]["meta.json"])["vocab_size"] == data.vocab_size == tokenizer.vocab_size
    assert 1000 < tokenizer.vocab_size <= 2000
    example = read_squad(str(dev))[0][0]
    in_window = data.eval.input_ids[0][data.eval.segment_ids[0] == 1][:-1]  # context tokens, then [SEP]
    assert in_window.tolist() == tokenizer.encode(example.context)[0][: len(in_window)]


def test_the_cache_holds_every_window_and_the_counts_start_up_needs(tmp_path, inputs):
    train, dev = inputs
    data = prepare(data_config(tmp_path, source=str(train), eval_source=str(dev)), workers=2)
    meta = json.loads((data.path / "meta.json").read_text())
    for split, features in (("train", data.train), ("eval", data.eval)):
        counts = meta["counts"][split]
        assert counts["windows"] == len(features)
        assert counts["tokens"] == int(np.asarray(features.lengths, np.int64).sum())
        assert counts["examples"] == int(features.example_index[-1]) + 1
    assert data.train.input_ids.dtype == np.uint16 and data.train.offsets is None
    assert data.eval is not None and data.eval.offsets is not None
    assert isinstance(data.eval_examples, StoredExamples)
    assert list(data.eval_examples) == read_squad(str(dev))[0]
    assert data.eval_examples[499] == read_squad(str(dev))[0][499]


def test_a_vocabulary_past_65536_ids_keeps_32_bit_token_ids(tmp_path):
    data = prepare(data_config(tmp_path, vocab_size=70_000))
    assert data.train.input_ids.dtype == np.int32


def test_peak_python_memory_of_a_build_does_not_grow_with_the_input(tmp_path, monkeypatch):
    """tracemalloc sees every Python object and numpy buffer. Holding the document as objects, or the
    features as lists, costs tens of kilobytes a question (a build once held ~29 KB a question); what
    may grow is the 8-byte digest per question id that finds duplicates (under 100 bytes with the set)."""
    monkeypatch.setattr(stream, "CHUNK", 1 << 14)  # read-ahead smaller than either input
    peaks = {}
    for questions in (500, 3500):
        source = tmp_path / f"train-{questions}.json"
        write_squad_file(str(source), questions, seed=questions)
        cfg = data_config(tmp_path, f"cache-{questions}", source=str(source))
        cache_key(cfg)  # hashing the input is not the part measured
        tracemalloc.start()
        try:
            prepare(cfg, workers=1)
            peaks[questions] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[3500] < 16 * 2**20, peaks
    assert (peaks[3500] - peaks[500]) / 3000 < 200, peaks  # bytes per extra question


BUILDER = """
import fcntl, json, sys, time
from pathlib import Path
if sys.argv[3] == "no-flock":  # a host whose shared filesystem ignores flock
    fcntl.flock = lambda *args: None
from elastic_qa.config import load_config, packaged_config
from elastic_qa.prep import cache
import dataclasses
real_build = cache._build
def counted_build(*args):
    print("BUILT", flush=True)
    time.sleep(0.3)  # the others arrive while this one builds
    real_build(*args)
cache._build = counted_build
base = load_config(packaged_config("tiny")).data
cfg = dataclasses.replace(base, cache_dir=sys.argv[1], source=sys.argv[2], eval_source="")
go = Path(sys.argv[1]).parent / "go"
while not go.exists():
    time.sleep(0.01)
data = cache.prepare(cfg, workers=1)
print("PATH", data.path, len(data.train), flush=True)
"""


def test_concurrent_builders_with_and_without_flock_publish_one_cache(tmp_path, inputs):
    train, _ = inputs
    cache_dir = tmp_path / "shared" / "cache"
    cache_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    modes = ["flock", "no-flock", "no-flock", "flock"]
    builders = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(cache_dir), str(train), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in modes
    ]
    time.sleep(1.5)  # let them all import and wait at the start line
    (tmp_path / "shared" / "go").touch()
    outputs = [process.communicate(timeout=120) for process in builders]
    assert [process.returncode for process in builders] == [0] * len(modes), outputs
    said = "".join(out for out, _ in outputs).splitlines()
    assert said.count("BUILT") == 1, said
    paths = {line for line in said if line.startswith("PATH")}
    assert len(paths) == 1, said
    key = paths.pop().split()[1].rsplit("/", 1)[1]
    left = sorted(p.name for p in cache_dir.iterdir())
    assert left == [key, f"{key}.lock", "content-hashes.json"]  # no staging, no lease


def test_a_lease_left_by_a_dead_builder_on_another_host_is_broken_once_stale(tmp_path, monkeypatch):
    cfg = data_config(tmp_path)
    key = cache_key(cfg)
    root = tmp_path / "cache"
    root.mkdir()
    left = root / f"{key}.lease"
    left.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "x"}))
    stale = root / f"{key}.tmp-elsewhere-1"
    (stale / "train").mkdir(parents=True)
    old = time.time() - lease.STALE_S - 10
    for path in (left, stale):
        os.utime(path, (old, old))
    data = prepare(cfg)
    assert (data.path / "meta.json").exists()
    assert sorted(p.name for p in root.iterdir()) == [key, f"{key}.lock"]


def test_a_live_builder_on_another_host_keeps_its_lease_and_staging(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    held = root / "k.lease"
    held.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "x"}))
    staging = root / "k.tmp-elsewhere-1"
    staging.mkdir()
    with lease.lease(held) as got:
        assert got is None  # someone else holds it: wait, do not build
    lease.clean_stale_staging(root, "k")
    assert held.exists() and staging.exists()


def test_the_loser_of_the_publishing_rename_discards_its_copy_and_keeps_the_winners(tmp_path):
    final, mine = tmp_path / "key", tmp_path / "key.tmp-me-1"
    final.mkdir()
    (final / "meta.json").write_text("winner")
    mine.mkdir()
    (mine / "meta.json").write_text("loser")
    assert lease.publish(mine, final) is False
    assert not mine.exists() and (final / "meta.json").read_text() == "winner"


def test_prepare_workers_is_not_part_of_the_key(tmp_path):
    cfg = Config(data=data_config(tmp_path))
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, prepare_workers=7))
    assert cache_key(cfg) == cache_key(other)
    assert build.default_workers() >= 1


def test_a_build_under_a_handler_that_turns_sigterm_into_an_exception_ends_its_helpers_quietly(
    tmp_path, inputs
):
    """`elastic-qa bench` turns SIGTERM into KeyboardInterrupt; forked helpers inherited that handler, so the
    terminate() that ends them after a build printed one traceback per helper."""
    train, dev = inputs
    script = (
        "import signal, sys\n"
        "from elastic_qa.prep import prepare\n"
        "from tests.prep.test_build import data_config\n"
        "from pathlib import Path\n"
        "def stop(signum, frame):\n"
        "    raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"cfg = data_config(Path({str(tmp_path)!r}), source={str(train)!r}, eval_source={str(dev)!r})\n"
        "prepare(cfg, workers=2)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
