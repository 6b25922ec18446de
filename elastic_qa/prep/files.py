"""Opening what preparation reads, whoever made it: a local file only when it is a regular file, and a
name read from a dataset's own metadata only when it stays inside the dataset's directory.

A FIFO would hang the open (no writer) or the read (a writer that never ends), a device such as /dev/zero
the read, and opening some devices acts on them; so a local file is opened only when stat says it is a
regular file, with O_NONBLOCK (an open that returns at once, should it have been swapped for a FIFO since),
and read only when fstat says again that what was opened is one. Remote filesystems (fsspec URLs) hold no
such files.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.compression import compr
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import infer_compression

from elastic_qa.data.examples import DataError


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def _require_regular(mode: int) -> None:
    kind = _kind(mode)
    if kind is not None:
        raise OSError(f"{kind}, not a regular file")


@contextlib.contextmanager
def open_regular(url: str, infer: bool = False) -> Iterator[IO[bytes]]:
    """A file's bytes (decompressed when `infer` and its name says so). A local file that is not a regular
    file raises OSError saying what it is (callers name the file), and is never opened."""
    compression = infer_compression(url) if infer else None
    fs, path = fsspec.core.url_to_fs(url)
    if not is_local(fs):
        with fsspec.open(url, "rb", compression=compression) as handle:
            yield handle
        return
    _require_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    with os.fdopen(fd, "rb") as raw:
        _require_regular(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        if compression is None:
            yield raw
            return
        with contextlib.closing(compr[compression](raw, mode="rb")) as handle:
            yield handle


def read_small(url: str, limit: int) -> bytes:
    """A metadata file's bytes (a regular file, at most `limit` bytes; OSError otherwise)."""
    parts, size = [], 0
    with open_regular(url) as handle:  # in pieces: read(limit) would allocate `limit` bytes up front
        while size <= limit and (part := handle.read(1 << 16)):
            parts.append(part)
            size += len(part)
    if size > limit:
        raise OSError(f"larger than {limit:,} bytes, more than such a file ever holds")
    return b"".join(parts)


def inside(fs: fsspec.AbstractFileSystem, directory: str, name: Any, what: str) -> str:
    """`directory/name` for a name read from the directory's own metadata (`what` says where, for the
    error); DataError unless it is a relative name that stays inside it, symlinks resolved (local)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise DataError(f"{what} {name!r} is not a file name")
    if posixpath.isabs(name) or ".." in name.split("/"):
        raise DataError(f"{what} {name!r} is not a name inside {directory}")
    path = f"{directory}/{name}"
    if is_local(fs):
        root, real = os.path.realpath(directory), os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise DataError(f"{what} {name!r} leads outside {directory} (to {real})")
    return path
