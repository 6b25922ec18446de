"""The JSON-lines sink: a full or failing log disk drops lines, never raises into training, and leaves
only whole lines behind for the readers."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import pytest

from elastic_qa.observe.follow import read_events
from elastic_qa.observe.log import _JsonLinesFile


class Disk:
    """A log file on a disk that can be made full: a write then stores what fits and fails the rest."""

    def __init__(self, path: Path, room: int | None = None) -> None:
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 (closed by the test)
        self.room = room  # bytes that still fit; None: plenty
        self.can_truncate = True

    def write(self, data: bytes | memoryview | str) -> int:
        data = data.encode() if isinstance(data, str) else data
        if self.room is None:
            return self.file.write(data)
        if self.room == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = self.file.write(bytes(data[: self.room]))
        self.room -= written
        return written

    def flush(self) -> None:
        pass

    def seek(self, offset: int, whence: int) -> int:
        return self.file.seek(offset, whence)

    def truncate(self, size: int) -> int:
        if not self.can_truncate:
            raise OSError(errno.EIO, "Input/output error")
        return self.file.truncate(size)


def line(event: str, **fields: object) -> str:
    return json.dumps({"event": event, "ts": 1.0, **fields}, ensure_ascii=False)


def whole_lines(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def test_a_full_disk_drops_lines_without_raising_and_writing_resumes_when_there_is_room(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "logs" / "rank-000.pid-1.jsonl"
    path.parent.mkdir()
    disk = Disk(path)
    sink = _JsonLinesFile(disk, echo=False)
    sink.msg(line("step", step=1))
    disk.room = 0
    for step in (2, 3, 4):
        sink.msg(line("step", step=step))  # would have raised ENOSPC into the training step
    assert sink.dropped == 3
    disk.room = None
    sink.msg(line("step", step=5))
    rows = whole_lines(path)
    assert [r["event"] for r in rows] == ["step", "log_lines_dropped", "step"]
    assert rows[1]["lines"] == 3 and [r.get("step") for r in rows if r["event"] == "step"] == [1, 5]
    assert len(capsys.readouterr().err.strip().splitlines()) == 1  # said once, not once a line


def test_a_line_cut_short_by_a_full_disk_is_taken_back_so_readers_see_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "rank-000.pid-1.jsonl"
    path.parent.mkdir()
    disk = Disk(path)
    sink = _JsonLinesFile(disk, echo=False)
    sink.msg(line("step", step=1))
    disk.room = 17  # half a line fits
    sink.msg(line("step", step=2, note="x" * 100))
    assert path.read_bytes().endswith(b"\n")  # the half line is gone again
    disk.room = None
    sink.msg(line("step", step=3))
    assert [r.get("step") for r in whole_lines(path)] == [1, None, 3]  # None: the log_lines_dropped line


def test_a_torn_line_that_cannot_be_taken_back_is_closed_off_and_readers_skip_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    path = run_dir / "logs" / "rank-000.pid-1.jsonl"
    path.parent.mkdir(parents=True)
    disk = Disk(path)
    disk.can_truncate = False
    sink = _JsonLinesFile(disk, echo=False)
    sink.msg(line("step", step=1))
    disk.room = 16  # cuts inside the two-byte UTF-8 sequence of "é"
    sink.msg(line("stop\u00e9", step=2))
    disk.room = None
    sink.msg(line("step", step=3))
    texts = path.read_bytes().splitlines()
    assert len(texts) == 4 and texts[1].startswith(b'{"event": "stop')  # the fragment, on its own line
    events = read_events(run_dir)
    assert sorted((e["event"], e.get("step", 0)) for e in events) == [
        ("log_lines_dropped", 0),
        ("step", 1),
        ("step", 3),
    ]


def test_writes_fail_with_enospc_while_the_log_fault_file_exists(tmp_path: Path) -> None:
    flag = tmp_path / "log-full"
    stream = io.BytesIO()
    sink = _JsonLinesFile(stream, echo=False, fault_file=flag)
    sink.msg(line("a"))
    flag.touch()
    sink.msg(line("b"))
    sink.msg(line("c"))
    flag.unlink()
    sink.msg(line("d"))
    rows = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert [r["event"] for r in rows] == ["a", "log_lines_dropped", "d"] and rows[1]["lines"] == 2


def test_a_closed_text_stream_such_as_a_dead_stderr_is_not_an_error() -> None:
    stream = io.StringIO()
    stream.close()
    sink = _JsonLinesFile(stream, echo=True)
    sink.msg(line("a"))
    sink.echo_line("[warning] a")
    assert sink.dropped == 1
