"""The published feature cache, opened: meta.json read, the columns memory-mapped read-only (the page cache
shares them between the ranks of a host), the evaluation examples read when evaluation runs.

Opening a cache costs the same whatever the data's size. Preparation (elastic_qa.prep) builds and
publishes the directory; this side only reads one that is complete.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from elastic_qa.data.examples import DataError, QAExample, line_example
from elastic_qa.data.features import Features

VOCAB_FILE = "tokenizer.json"  # a wordpiece vocabulary, in a cache and in an exported model's directory


@dataclass
class PreparedData:
    key: str
    path: Path
    train: Features
    eval: Features | None
    eval_examples: Sequence[QAExample]  # read from disk on use (StoredExamples)
    vocab_size: int
    skipped: dict[str, int] = field(default_factory=dict)  # malformed records skipped, per split
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # per split: examples, windows, tokens
    vocabulary: str | None = None  # the tokenizer.json text the windows were made with (wordpiece), if any


def _read_split(directory: Path, windows: int) -> Features:
    columns: dict[str, Any] = {}  # the Features fields: arrays, and None for absent offsets
    for name in Features.COLUMNS:
        path = directory / f"{name}.npy"
        if name == "offsets" and not path.exists():  # kept for the evaluation split only
            columns[name] = None
            continue
        columns[name] = np.load(path, mmap_mode="r")
        if len(columns[name]) != windows:
            raise ValueError(f"{path.name} has {len(columns[name])} rows, meta.json says {windows}")
    return Features(**columns)


def open_cache(final: Path, key: str) -> PreparedData:
    """The published cache at `final`: meta.json and memory maps (a damaged one is a DataError)."""
    try:
        meta = json.loads((final / "meta.json").read_text())
        counts = meta["counts"]
        has_eval = "eval" in counts
        vocabulary = final / VOCAB_FILE
        return PreparedData(
            key=key,
            path=final,
            train=_read_split(final / "train", int(counts["train"]["windows"])),
            eval=_read_split(final / "eval", int(counts["eval"]["windows"])) if has_eval else None,
            eval_examples=StoredExamples(final / "eval") if has_eval else [],
            vocab_size=int(meta["vocab_size"]),
            skipped={split: int(c.get("skipped", 0)) for split, c in counts.items()},
            counts=counts,
            vocabulary=vocabulary.read_text("utf-8") if vocabulary.is_file() else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"feature cache {final} is damaged ({err}); delete that directory to rebuild"
        ) from None


class StoredExamples(Sequence[QAExample]):
    """Examples that prep.columns.ExampleWriter stored: opening maps the index; each read decodes a line."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "examples.jsonl"
        self._starts = np.load(directory / "examples.index.npy", mmap_mode="r")
        if len(self._starts) < 1:
            raise ValueError(f"{directory}: empty example index")
        self._data: mmap.mmap | None = None

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": None}  # a memory map is not sent: the receiver maps again

    def _bytes(self) -> mmap.mmap:
        if self._data is None:
            with open(self.path, "rb") as handle:
                self._data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return self._data

    @overload
    def __getitem__(self, index: int) -> QAExample: ...
    @overload
    def __getitem__(self, index: slice) -> list[QAExample]: ...
    def __getitem__(self, index: int | slice) -> QAExample | list[QAExample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return line_example(self._bytes()[int(self._starts[index]) : int(self._starts[index + 1])])

    def __iter__(self) -> Iterator[QAExample]:
        with open(self.path, "rb") as handle:
            for line in handle:
                yield line_example(line)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence semantics, as list has
