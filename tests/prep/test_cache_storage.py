"""The feature cache on storage that refuses things (issue 21, item 8): a cache directory that cannot be
written is one line and exit 2 (and a published cache there is still served), and a filesystem without
flock (NFS without lockd: ENOLCK) falls back to the lease, which still keeps a second builder out."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.prep import cache, prepare
from elastic_qa.prep.build import TRAIN_COLUMNS
from tests.conftest import REPO
from tests.prep.test_cache import data_config, squad_file

WAIT_S = 120  # generous: the machine may be loaded; a wait that runs out is a failure, never a pass


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"gave up waiting for {what} ({path})"
        time.sleep(0.01)


def _elastic_qa_prepare(*args: str, wrap: list[str] = ()) -> subprocess.CompletedProcess:
    command = [*wrap, sys.executable, "-m", "elastic_qa.cli", "prepare", "--config", "tiny", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def _can_mount_privately() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-m", "true"]).returncode == 0


def _read_only(directory: Path, *, fresh: bool) -> list[str]:
    """A command prefix that runs the rest with `directory` read-only (in a private mount namespace): an
    empty tmpfs when `fresh`, else the directory's own contents."""
    mount = (
        f"mount -t tmpfs -o ro,size=1m tmpfs {directory}"
        if fresh
        else f"mount --bind {directory} {directory} && mount -o remount,bind,ro {directory}"
    )
    return ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh"]


def test_prepare_into_a_cache_dir_under_a_file_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = _elastic_qa_prepare(f"data.cache_dir={blocker}/cache")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    assert lines[0].startswith(f"elastic-qa: data.cache_dir={blocker}/cache: cannot write")
    assert blocker.read_text() == "not a directory"


@pytest.mark.skipif(not _can_mount_privately(), reason="needs unshare -m to mount a read-only directory")
@pytest.mark.parametrize("where", ["the cache dir", "a directory to create in it"])
def test_prepare_into_a_read_only_cache_dir_is_one_line_and_exit_2(tmp_path, where):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    cache_dir = readonly if where == "the cache dir" else readonly / "cache"
    result = _elastic_qa_prepare(f"data.cache_dir={cache_dir}", wrap=_read_only(readonly, fresh=True))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    assert f"data.cache_dir={cache_dir}: cannot write" in lines[0] and "Read-only file system" in lines[0]


@pytest.mark.skipif(not _can_mount_privately(), reason="needs unshare -m to mount a read-only directory")
def test_a_read_only_cache_dir_still_serves_the_cache_published_in_it(tmp_path):
    source = squad_file(tmp_path, "train.json")
    cache_dir = tmp_path / "cache"
    built = _elastic_qa_prepare(f"data.source={source}", f"data.cache_dir={cache_dir}")
    assert built.returncode == 0, built.stderr[-3000:]
    os.utime(source)  # same content, new mtime: its hash is computed again and cannot be remembered
    result = _elastic_qa_prepare(
        f"data.source={source}", f"data.cache_dir={cache_dir}", wrap=_read_only(cache_dir, fresh=False)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split(":")[0] == built.stdout.split(":")[0]  # "cache <the same directory>"


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP], ids=["ENOLCK", "EOPNOTSUPP"])
def test_a_filesystem_without_flock_still_builds_the_cache(tmp_path, monkeypatch, code):
    def no_flock(_fd, _operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(cache.fcntl, "flock", no_flock)
    data = prepare(data_config(tmp_path / "cache"))
    assert len(data.train) > 0 and not (tmp_path / "cache" / f"{data.key}.lease").exists()


def test_another_flock_error_is_not_taken_for_a_missing_flock(tmp_path, monkeypatch):
    def broken(_fd, _operation):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(cache.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Bad file descriptor"):
        prepare(data_config(tmp_path / "cache"))


def _prepare_in_child(cfg, results) -> None:
    data = prepare(cfg)
    complete = all(len(getattr(data.train, c)) == len(data.train) for c in TRAIN_COLUMNS)
    results.put((str(data.path), len(data.train), complete))


def test_without_flock_the_lease_keeps_a_second_builder_out(tmp_path, monkeypatch):
    """Two processes of one host on a filesystem whose flock fails with ENOLCK: the second finds the
    first's lease while the first is building (held there until it has), waits, and builds nothing."""
    cfg = data_config(tmp_path / "cache")
    building, waiting, builds = tmp_path / "building", tmp_path / "waiting", tmp_path / "builds.log"

    def no_flock(_fd, _operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    real_build, real_lease = cache._build, cache.lease

    def build_once_the_other_waits(*args):
        with open(builds, "a") as handle:
            handle.write(f"build {os.getpid()}\n")
        building.touch()
        _wait_for(waiting, "the second process to find the lease held")
        real_build(*args)

    @contextlib.contextmanager
    def seen_lease(path):
        with real_lease(path) as held:
            if held is None:
                waiting.touch()
            yield held

    # Inherited by the forked children.
    monkeypatch.setattr(cache.fcntl, "flock", no_flock)
    monkeypatch.setattr(cache, "_build", build_once_the_other_waits)
    monkeypatch.setattr(cache, "lease", seen_lease)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    first = context.Process(target=_prepare_in_child, args=(cfg, results))
    first.start()
    _wait_for(building, "the first process to start building")
    second = context.Process(target=_prepare_in_child, args=(cfg, results))
    second.start()
    for child in (first, second):
        child.join(timeout=WAIT_S)
    assert [first.exitcode, second.exitcode] == [0, 0]
    outcomes = [results.get(timeout=5) for _ in range(2)]
    assert builds.read_text().splitlines() == [f"build {first.pid}"]
    assert len({path for path, *_ in outcomes}) == 1
    assert all(windows > 0 and complete for _, windows, complete in outcomes)
