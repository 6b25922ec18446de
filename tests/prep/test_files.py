"""Hostile files under preparation: a FIFO or a device where a file is expected, and a `datasets` directory
whose own JSON names files outside it or gives a string for a list. Each is refused at once in one line
naming the file and what is wrong (exit 2), or, in the cache directory's own files, passed over.

What could hang runs in a subprocess with a generous timeout: code that waits on a FIFO or reads /dev/zero
fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from elastic_qa.config import load_config, packaged_config  # noqa: E402
from elastic_qa.data.examples import DataError  # noqa: E402
from elastic_qa.prep import cache_key  # noqa: E402
from elastic_qa.prep.sources import read_squad  # noqa: E402
from tests.conftest import REPO, tiny_overrides  # noqa: E402

TIMEOUT_S = 60  # the checks take a second; what hangs fails here instead
CONTEXT = "Paris is the capital of France."
OUTSIDE = "outside-the-dataset"  # a folder beside the dataset, holding what its metadata must not reach

# Runs the command line with an audit hook that prints every file opened under the paths given first.
AUDITED = """
import os, runpy, sys
watched = [os.path.realpath(p) for p in sys.argv[1].split(os.pathsep)]
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if any(path == w or path.startswith(w + os.sep) for w in watched):
            sys.__stdout__.write(f"opened: {path}\\n")
            sys.__stdout__.flush()
sys.addaudithook(hook)
sys.argv = ["elastic-qa", *sys.argv[2:]]
runpy.run_module("elastic_qa.cli", run_name="__main__", alter_sys=True)
"""


def row(qid: str) -> dict:
    answers = {"text": ["Paris"], "answer_start": [0]}
    return {
        "id": qid,
        "title": "T",
        "context": CONTEXT,
        "question": "What is the capital?",
        "answers": answers,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `datasets` save_to_disk directory of two questions (one Arrow file), to copy and spoil."""
    path = tmp_path_factory.mktemp("saved") / "saved"
    datasets.Dataset.from_list([row("q1"), row("q2")]).save_to_disk(str(path))
    return path


def spoiled(saved: Path, tmp_path: Path, **state: object) -> Path:
    """A copy of `saved` with these fields of its state.json replaced, and a valid copy of it beside it in
    OUTSIDE (so that a name leading there would be read without complaint)."""
    shutil.copytree(saved, tmp_path / OUTSIDE)
    copy = shutil.copytree(saved, tmp_path / "dataset")
    document = json.loads((copy / "state.json").read_text())
    (copy / "state.json").write_text(json.dumps({**document, **state}))
    return copy


def data_file(saved: Path) -> str:
    return json.loads((saved / "state.json").read_text())["_data_files"][0]["filename"]


def run(*args: str, module: str = "elastic_qa.cli") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def prepare(tmp_path: Path, *overrides: str, watched: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """`elastic-qa prepare`; with `watched`, under an audit hook that prints `opened: PATH` on stdout for
    every file opened under those paths."""
    args = ("prepare", "--config", "tiny", f"data.cache_dir={tmp_path / 'cache'}", *overrides)
    if not watched:
        return run(*args)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", AUDITED, os.pathsep.join(map(str, watched)), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The one line an exit 2 says, holding every one of `words`."""
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-qa: "), result.stderr[-2000:]
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "name",
    [
        "../../../../../../../../dev/zero",
        "../../../../../../../../etc/passwd",
        f"../{OUTSIDE}/data-00000-of-00001.arrow",
    ],
)
def test_prepare_refuses_a_state_json_naming_a_file_outside_its_directory_and_opens_nothing_there(
    saved, tmp_path, name
):
    dataset = spoiled(saved, tmp_path, _data_files=[{"filename": name}])
    watched = (tmp_path / OUTSIDE, Path("/dev/zero"), Path("/etc/passwd"))
    result = prepare(tmp_path, f"data.source={dataset}", "data.eval_source=", watched=watched)
    field = "state.json's _data_files[0].filename"
    assert "opened:" not in result.stdout, result.stdout
    refused(result, str(dataset), field, repr(name), "is not a name inside")


def test_prepare_refuses_a_state_json_that_is_a_link_to_a_file_outside_and_does_not_open_it(saved, tmp_path):
    dataset = spoiled(saved, tmp_path)
    (dataset / "state.json").unlink()
    (dataset / "state.json").symlink_to(tmp_path / OUTSIDE / "state.json")
    result = prepare(tmp_path, f"data.source={dataset}", "data.eval_source=", watched=(tmp_path / OUTSIDE,))
    assert "opened:" not in result.stdout, result.stdout
    refused(result, str(dataset), "'state.json' leads outside", str(tmp_path / OUTSIDE / "state.json"))


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", f"../{OUTSIDE}/x.arrow", "", 7])
def test_a_data_file_that_state_json_names_outside_its_directory_is_refused(saved, tmp_path, name):
    dataset = spoiled(saved, tmp_path, _data_files=[{"filename": name}])
    shutil.copy(saved / data_file(saved), tmp_path / OUTSIDE / "x.arrow")  # valid rows: read if not refused
    with pytest.raises(DataError, match=r"state\.json's _data_files\[0\]\.filename") as info:
        read_squad(str(dataset))
    assert str(dataset) in str(info.value) and repr(name) in str(info.value)


def test_a_symlink_in_a_saved_dataset_is_followed_only_while_it_stays_inside(saved, tmp_path):
    dataset = spoiled(saved, tmp_path, _data_files=[{"filename": "link.arrow"}])
    (dataset / "link.arrow").symlink_to(dataset / data_file(saved))
    assert [e.id for e in read_squad(str(dataset))[0]] == ["q1", "q2"]
    (dataset / "link.arrow").unlink()
    (dataset / "link.arrow").symlink_to(tmp_path / OUTSIDE / data_file(saved))
    with pytest.raises(DataError, match=r"'link.arrow' leads outside .* \(to .*outside-the-dataset/"):
        read_squad(str(dataset))


@pytest.mark.parametrize(
    ("files", "said"),
    [
        (
            "data-00000-of-00001.arrow",
            r"_data_files is a string \(\"data-00000-of-00001.arrow\"\), not a list",
        ),
        (["data-00000-of-00001.arrow"], r"_data_files\[0\] is a string .*, not an object with a filename"),
        ({"filename": "x.arrow"}, r"_data_files is an object .*, not a list of objects"),
    ],
)
def test_data_files_of_the_wrong_type_are_an_error_naming_the_field(saved, tmp_path, files, said):
    dataset = spoiled(saved, tmp_path, _data_files=files)
    with pytest.raises(DataError, match=rf"{dataset}: state\.json's {said}"):
        read_squad(str(dataset))


def test_splits_given_as_a_string_are_an_error_not_a_list_of_its_letters(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "dict" / "train")
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": "train"}))
    for entry in (tmp_path / "dict", f"{tmp_path / 'dict'}:train"):
        said = r"dataset_dict\.json's splits is a string \(\"train\"\), not a list of names"
        with pytest.raises(DataError, match=said):
            read_squad(str(entry))
    result = prepare(tmp_path, f"data.source={tmp_path / 'dict'}:train", "data.eval_source=")
    refused(result, "dataset_dict.json's splits is a string", "not a list of names")


def test_a_split_named_dot_dot_does_not_lead_to_the_directory_above(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "parent")  # a valid dataset: read if `..` were followed
    shutil.copytree(saved, tmp_path / "parent" / "dict" / "train")
    (tmp_path / "parent" / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", ".."]}))
    with pytest.raises(DataError, match=r"dataset_dict\.json's splits\[1\] '\.\.' is not a name inside"):
        read_squad(f"{tmp_path / 'parent' / 'dict'}:..")


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("where", ["saved dataset's data file", "glob match", "source", "vocab_file"])
def test_prepare_refuses_a_fifo_where_a_file_is_read_at_once_naming_it(saved, tmp_path, where):
    if where == "saved dataset's data file":
        dataset = spoiled(saved, tmp_path, _data_files=[{"filename": "pipe.arrow"}])
        path, setting = fifo(dataset / "pipe.arrow"), f"data.source={dataset}"
    elif where == "glob match":
        (tmp_path / "shards").mkdir()
        shutil.copy(saved / data_file(saved), tmp_path / "shards" / "a.arrow")
        path, setting = (
            fifo(tmp_path / "shards" / "b.arrow"),
            f"data.source={tmp_path / 'shards' / '*.arrow'}",
        )
    elif where == "source":
        path = fifo(tmp_path / "train.jsonl")
        setting = f"data.source={path}"
    else:
        path = fifo(tmp_path / "tokenizer.json")
        setting = f"data.vocab_file={path}"
    extra = ("data.tokenizer=wordpiece",) if where == "vocab_file" else ("data.eval_source=",)
    refused(prepare(tmp_path, setting, *extra), str(path), "a FIFO, not a regular file")


def test_prepare_refuses_a_character_device_named_as_the_source(tmp_path):
    refused(
        prepare(tmp_path, "data.source=/dev/zero", "data.eval_source="), "/dev/zero", "a character device"
    )


def test_training_exits_2_naming_a_fifo_matched_by_the_source_glob(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "data")
    path = fifo(tmp_path / "data" / "z.arrow")
    overrides = tiny_overrides(
        tmp_path / "run", tmp_path / "cache", f"data.source={tmp_path / 'data' / '*.arrow'}"
    )
    result = run("--config", "tiny", *overrides, "data.eval_source=", module="elastic_qa.train")
    assert result.returncode == 2, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("elastic-qa:")]
    assert len(said) == 1 and f"{path}: cannot read (a FIFO" in said[0], result.stderr[-2000:]


def test_a_fifo_as_the_cache_directorys_build_lock_is_refused_naming_it(tmp_path):
    cfg = load_config(packaged_config("tiny"), [f"data.cache_dir={tmp_path / 'cache'}"])
    lock = fifo(tmp_path / "cache" / f"{cache_key(cfg)}.lock")
    refused(prepare(tmp_path), str(lock), "not a regular file")


def test_a_fifo_as_the_content_hash_index_is_passed_over_and_replaced(saved, tmp_path):
    fifo(tmp_path / "cache" / "content-hashes.json")
    result = prepare(tmp_path, f"data.source={saved}", "data.eval_source=")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "cache" / "content-hashes.json").is_file()


def test_a_fifo_as_a_lease_is_judged_an_unreadable_lease_at_once(tmp_path):
    lease = fifo(tmp_path / "key.lease")
    code = (
        "from pathlib import Path; from elastic_qa.prep.lease import read_holder; "
        f"print(read_holder(Path({str(lease)!r})).verdict.why)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0 and result.stdout.startswith("unreadable lease"), result.stderr[-2000:]
