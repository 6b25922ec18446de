"""The feature cache's files, written: `.npy` columns appended batch by batch, and examples stored as
indexed JSON Lines (data.cache reads them).

A column's row count is known only at the end of a streaming build, so its `.npy` header is written last
into room reserved at the start (numpy reads any header padded with spaces to a multiple of 64 bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from elastic_qa.data.examples import QAExample, example_line

_HEADER_BYTES = 128  # magic (6) + version (2) + length (2) + the header dict, space-padded


def npy_header(dtype: npt.DTypeLike, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 `.npy` header of exactly _HEADER_BYTES bytes."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = repr({"descr": descr, "fortran_order": False, "shape": shape})
    room = _HEADER_BYTES - 10
    if len(text) + 1 > room:
        raise ValueError(f"shape {shape} does not fit the reserved .npy header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", room) + (text.ljust(room - 1) + "\n").encode("latin1")


class ColumnWriter:
    """One `.npy` file grown by appending rows of a fixed shape and dtype."""

    def __init__(self, path: Path, dtype: npt.DTypeLike, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), row_shape
        self.rows = 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close(), after the last append)
        self._file.write(b"\0" * _HEADER_BYTES)

    def append(self, rows: np.ndarray) -> None:
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of shape {rows.shape[1:]}, expected {self.row_shape}")
        self._file.write(np.ascontiguousarray(rows, dtype=self.dtype).data)
        self.rows += len(rows)

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, (self.rows, *self.row_shape)))
        self._file.close()


class ExampleWriter:
    """Examples as JSON Lines plus an int64 index of where each line starts (one more for the end)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._file = open(directory / "examples.jsonl", "wb")  # noqa: SIM115 (closed by close())
        self._starts = ColumnWriter(directory / "examples.index.npy", np.int64, ())
        self._position = 0

    def append(self, examples: Sequence[QAExample]) -> None:
        starts, lines = [], []
        for e in examples:
            data = example_line(e)
            starts.append(self._position)
            self._position += len(data)
            lines.append(data)
        self._file.write(b"".join(lines))
        self._starts.append(np.asarray(starts, np.int64))

    def close(self) -> None:
        self._starts.append(np.asarray([self._position], np.int64))
        self._starts.close()
        self._file.close()
