"""Streaming, parallel feature building: files in, `.npy` columns out, memory bounded by a few chunks.

The reading process cuts the input into chunks of raw records (data.sources); worker processes validate
each chunk and turn its examples into windows with the model family's `features` (a pure function of a
batch of examples); the reading process drops repeated question ids and appends the windows to the
columns in chunk order. Chunks depend on the input alone, so any number of workers gives byte-identical
files. At most two chunks per worker are in flight: the reader never runs ahead of the writer.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elastic_qa.data.columns import ColumnWriter, ExampleWriter
from elastic_qa.data.features import Features
from elastic_qa.data.sources import Chunk, ExampleReader, parse_chunk
from elastic_qa.data.squad import QAExample

IN_FLIGHT_PER_WORKER = 2
INLINE_CHUNKS = 4  # done in the reading process before worker processes are worth starting

# Columns written per split: training never reads the character offsets (by far the largest column).
TRAIN_COLUMNS = tuple(c for c in Features.COLUMNS if c != "offsets")
EVAL_COLUMNS = Features.COLUMNS


def default_workers() -> int:
    """Processes that tokenise: one per CPU core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest type that holds every token id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


@dataclass
class SplitCounts:
    examples: int = 0
    windows: int = 0
    tokens: int = 0  # real (non-padding) tokens over all windows


@dataclass
class Done:
    """A chunk's result, as sent back to the reading process."""

    url: str
    names: list[tuple[str, str]]  # (record name, question id) per example
    skipped: int
    error: str | None
    features: Features | None
    examples: list[QAExample] | None  # only when the split keeps them (evaluation)


def work(chunk: Chunk, featurizer: Any, cfg: Any, evaluation: bool) -> Done:
    """Validate a chunk and build its windows (in a worker process, or inline)."""
    parsed = parse_chunk(chunk, cfg.data.skip_malformed)
    examples = [example for _, example in parsed.records]
    features = featurizer.features(examples, cfg) if examples else None
    if features is not None and not evaluation:
        features.offsets = None  # not stored: not worth sending back
    return Done(
        chunk.url, parsed.names(), parsed.skipped, parsed.error, features, examples if evaluation else None
    )


# The featurizer and config of a worker process (set once by the pool's initializer).
_WORKER: tuple[Any, Any] | None = None


def _init_worker(featurizer: Any, cfg: Any) -> None:
    global _WORKER
    _WORKER = (featurizer, cfg)


def _work_in_pool(chunk: Chunk, evaluation: bool) -> Done:
    assert _WORKER is not None
    return work(chunk, *_WORKER, evaluation)


class Workers:
    """`work` on each chunk in order: inline (one worker, or the first few chunks) or in a process pool."""

    def __init__(
        self, featurizer: Any, cfg: Any, workers: int, beat: Callable[[], None] = lambda: None
    ) -> None:
        self.featurizer, self.cfg, self.workers = featurizer, cfg, workers
        self.beat = beat  # called once per chunk (the build lease's heartbeat)
        self.pool: Any = None
        self.inline = 0

    def _start_pool(self) -> None:
        # fork shares the featurizer without pickling it and starts in milliseconds; with other threads
        # alive (a fork would copy their locks mid-use), a fresh interpreter per worker.
        method = "fork" if threading.active_count() == 1 and os.name == "posix" else "spawn"
        context = multiprocessing.get_context(method)
        self.pool = context.Pool(self.workers, _init_worker, (self.featurizer, self.cfg))

    def map(self, chunks: Iterable[Chunk], evaluation: bool) -> Iterator[Done]:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            self.beat()
            if self.pool is None and (self.workers == 1 or self.inline < INLINE_CHUNKS):
                self.inline += 1  # small inputs never pay for starting processes
                yield work(chunk, self.featurizer, self.cfg, evaluation)
                continue
            if self.pool is None:
                self._start_pool()
            pending.append(self.pool.apply_async(_work_in_pool, (chunk, evaluation)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()  # also on error: nothing is left running
            self.pool.join()
            self.pool = None


def _kept(features: Features, keep: list[bool]) -> Features:
    """The windows of the kept examples, `example_index` renumbered over them."""
    mask = np.asarray(keep)
    renumber = np.cumsum(mask) - 1
    rows = mask[features.example_index]
    columns = {
        c: None if getattr(features, c) is None else getattr(features, c)[rows] for c in Features.COLUMNS
    }
    columns["example_index"] = renumber[features.example_index[rows]].astype(np.int32)
    return Features(**columns)


def build_split(
    reader: ExampleReader | None,
    chunks: Iterable[Chunk],
    workers: Workers,
    directory: Path,
    vocab_size: int,
    evaluation: bool,
) -> SplitCounts:
    """Write one split's columns (and, for evaluation, its examples) into `directory`.

    `reader` filters repeated ids and counts what was skipped (None: the examples are known valid).
    """
    directory.mkdir(parents=True)
    columns = EVAL_COLUMNS if evaluation else TRAIN_COLUMNS
    writers: dict[str, ColumnWriter] = {}
    stored = ExampleWriter(directory) if evaluation else None
    counts = SplitCounts()
    id_type = ids_dtype(vocab_size)
    unique = reader.unique() if reader is not None else None
    try:
        for done in workers.map(chunks, evaluation):
            keep = [True] * len(done.names)
            if reader is not None and unique is not None:
                keep = reader.admit(unique, done.url, done.names, done.skipped, done.error)
            if done.features is None or not any(keep):
                continue
            features = done.features if all(keep) else _kept(done.features, keep)
            if len(features) and int(features.input_ids.max()) >= vocab_size:
                raise ValueError(f"a token id is >= the tokenizer's vocab_size {vocab_size}")
            shifted = {"example_index": features.example_index + counts.examples}
            for name in columns:
                rows = shifted.get(name, getattr(features, name))
                if name not in writers:
                    dtype = id_type if name == "input_ids" else rows.dtype
                    writers[name] = ColumnWriter(directory / f"{name}.npy", dtype, rows.shape[1:])
                writers[name].append(rows)
            if stored is not None and done.examples is not None:
                stored.append([e for e, k in zip(done.examples, keep, strict=True) if k])
            counts.examples += sum(keep)
            counts.windows += len(features)
            counts.tokens += int(features.lengths.sum())
        if reader is not None:
            reader.finish()
    finally:
        for writer in writers.values():
            writer.close()
        if stored is not None:
            stored.close()
    return counts
