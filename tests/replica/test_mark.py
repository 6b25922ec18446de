"""The job's committed step on disk (elastic_qa/replica/mark.py): real files, FIFOs and symlinks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_qa.replica.mark import MAX_BYTES, CommitMark

TIMEOUT = 30.0


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def mark(run_dir: Path) -> CommitMark:
    return CommitMark(run_dir)


def read_elsewhere(run_dir: Path, *then: str) -> list[str]:
    """CommitMark(run_dir).read() (and then the statements `then`) in a child process, which a test can give
    up on: a read that blocks fails the test at TIMEOUT instead of hanging the suite. Its printed lines."""
    code = "\n".join(
        [
            "import sys",
            "from elastic_qa.replica.mark import CommitMark",
            "mark = CommitMark(sys.argv[1])",
            "print(mark.read())",
            *then,
        ]
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading the mark did not return within {TIMEOUT} s")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_no_mark_reads_as_zero(mark: CommitMark, run_dir: Path) -> None:
    assert not mark.path.exists()
    assert mark.read() == 0
    assert mark.path == run_dir / "replica" / "committed-step"
    assert mark.directory.is_dir()  # made by the constructor


def test_advance_moves_the_mark_forward_only(mark: CommitMark) -> None:
    mark.advance(5)
    assert mark.read() == 5
    mark.advance(3)
    assert mark.read() == 5
    mark.advance(5)
    assert mark.read() == 5
    mark.advance(6, final=True)
    assert mark.read() == 6
    assert mark.path.read_text() == "6"


def test_the_mark_is_written_at_the_first_step_then_once_a_second_and_at_the_last(run_dir: Path) -> None:
    now = [100.0]
    mark = CommitMark(run_dir, clock=lambda: now[0])
    mark.advance(1)
    mark.advance(2)  # within the second: not written (it may lag, never lead)
    assert mark.read() == 1
    now[0] += 1.0
    mark.advance(3)
    assert mark.read() == 3
    mark.advance(4, final=True)  # the last step always: a late group learns the job is done
    assert mark.read() == 4


def test_advance_leaves_no_staging_file_behind(mark: CommitMark) -> None:
    for step in (1, 2, 3):
        mark.advance(step)
    assert sorted(p.name for p in mark.directory.iterdir()) == ["committed-step"]


def test_two_marks_on_one_run_dir_see_each_other(run_dir: Path) -> None:
    first, second = CommitMark(run_dir), CommitMark(run_dir)
    first.advance(3)
    assert second.read() == 3
    second.advance(8)
    assert first.read() == 8
    first.advance(6)  # behind the other's mark: not moved back
    assert (first.read(), second.read()) == (8, 8)
    assert read_elsewhere(run_dir) == ["8"]  # and another process


@pytest.mark.parametrize(
    "content",
    [b"", b"\n", b"abc", b"-3", b"+4", b"1.5", b"1e3", b"0x10", b"12abc", b"7 8", b"\x00\xff", "٣".encode()],
)
def test_a_mark_that_is_not_a_plain_number_reads_as_zero(mark: CommitMark, content: bytes) -> None:
    mark.path.write_bytes(content)
    assert mark.read() == 0


def test_a_number_with_a_newline_reads_as_the_number(mark: CommitMark) -> None:
    mark.path.write_bytes(b"42\n")
    assert mark.read() == 42


def test_a_garbage_mark_is_moved_forward_by_advance(mark: CommitMark) -> None:
    mark.path.write_bytes(b"garbage")
    mark.advance(2)
    assert mark.read() == 2


@pytest.mark.parametrize("content", [b"x" * 1_000_000, b"7x" + b"8" * 1_000_000, b"\n" * 100_000])
def test_a_huge_mark_reads_as_zero(mark: CommitMark, content: bytes) -> None:
    mark.path.write_bytes(content)
    assert mark.read() == 0


@pytest.mark.parametrize("content", [b"9" * (MAX_BYTES * 4), b"7" + b" " * 1_000_000 + b"x"])
def test_a_mark_longer_than_max_bytes_reads_as_zero(mark: CommitMark, content: bytes) -> None:
    mark.path.write_bytes(content)
    assert mark.read() == 0


def test_a_symlink_in_place_of_the_mark_reads_as_zero(mark: CommitMark, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("42")
    mark.path.symlink_to(target)
    assert mark.read() == 0


def test_advance_replaces_a_symlink_and_leaves_its_target_alone(mark: CommitMark, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("1")
    mark.path.symlink_to(target)
    mark.advance(3)
    assert not mark.path.is_symlink()
    assert mark.read() == 3
    assert target.read_text() == "1"


def test_a_fifo_in_place_of_the_mark_does_not_hang(mark: CommitMark, run_dir: Path) -> None:
    os.mkfifo(mark.path)
    assert read_elsewhere(run_dir, "mark.advance(4)", "print(mark.read())") == ["0", "4"]
    assert mark.path.is_file() and not mark.path.is_fifo()


@pytest.fixture
def fifo_with_a_writer(mark: CommitMark) -> Iterator[int]:
    """A FIFO in place of the mark that a process holds open for writing (and writes nothing)."""
    os.mkfifo(mark.path)
    fd = os.open(mark.path, os.O_RDWR | os.O_NONBLOCK)  # opens at once: no waiting for a reader
    try:
        yield fd
    finally:
        os.close(fd)


def test_a_fifo_with_a_number_written_into_it_does_not_hang(run_dir: Path, fifo_with_a_writer: int) -> None:
    os.write(fifo_with_a_writer, b"9")
    assert read_elsewhere(run_dir)[0] in ("0", "9")  # either is a wait at most; no hang, no error


def test_a_fifo_held_open_by_a_writer_reads_as_zero(run_dir: Path, fifo_with_a_writer: int) -> None:
    assert read_elsewhere(run_dir) == ["0"]


def test_a_directory_in_place_of_the_mark_reads_as_zero(mark: CommitMark) -> None:
    mark.path.mkdir()
    assert mark.read() == 0
