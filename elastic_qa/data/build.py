"""Streaming, parallel feature building: examples in, `.npy` columns out, memory bounded by a few batches.

The reader (this process) validates examples in file order and cuts them into batches of a fixed size;
worker processes turn each batch into windows with the model family's `features` (a pure function of the
batch); the results are written in batch order. The batches do not depend on the number of workers, so
any number gives byte-identical files. At most two batches per worker are in flight (back-pressure: the
reader never runs ahead of the writers).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elastic_qa.data.columns import ColumnWriter, ExampleWriter
from elastic_qa.data.features import Features
from elastic_qa.data.squad import QAExample

BATCH_EXAMPLES = 256  # part of the output's identity only through ordering: never depends on workers
IN_FLIGHT_PER_WORKER = 2
INLINE_BATCHES = 4  # tokenised in the reading process before worker processes are worth starting

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
    """The narrowest unsigned type that holds every token id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


@dataclass
class SplitCounts:
    examples: int = 0
    windows: int = 0
    tokens: int = 0  # real (non-padding) tokens over all windows


# The featurizer and config of a worker process (set once by the pool's initializer).
_WORKER: tuple[Any, Any] | None = None


def _init_worker(featurizer: Any, cfg: Any) -> None:
    global _WORKER
    _WORKER = (featurizer, cfg)


def _featurize(examples: list[QAExample]) -> Features:
    assert _WORKER is not None
    featurizer, cfg = _WORKER
    return featurizer.features(examples, cfg)


def _batches(examples: Iterable[QAExample]) -> Iterator[list[QAExample]]:
    batch: list[QAExample] = []
    for example in examples:
        batch.append(example)
        if len(batch) == BATCH_EXAMPLES:
            yield batch
            batch = []
    if batch:
        yield batch


class Featurizers:
    """`features` of each batch in order: here (one worker) or in a pool of worker processes."""

    def __init__(self, featurizer: Any, cfg: Any, workers: int) -> None:
        self.featurizer, self.cfg, self.workers = featurizer, cfg, workers
        self.pool: Any = None
        self.inline = 0  # batches done in this process before the pool started

    def _start_pool(self) -> None:
        # fork shares the featurizer without pickling it and starts in milliseconds; with other threads
        # alive (a fork would copy their locks mid-use), a fresh interpreter per worker.
        method = "fork" if threading.active_count() == 1 and os.name == "posix" else "spawn"
        context = multiprocessing.get_context(method)
        self.pool = context.Pool(self.workers, _init_worker, (self.featurizer, self.cfg))

    def map(self, examples: Iterable[QAExample]) -> Iterator[tuple[list[QAExample], Features]]:
        pending: collections.deque = collections.deque()
        for batch in _batches(examples):
            if self.pool is None and (self.workers == 1 or self.inline < INLINE_BATCHES):
                self.inline += 1  # small inputs never pay for starting processes
                yield batch, self.featurizer.features(batch, self.cfg)
                continue
            if self.pool is None:
                self._start_pool()
            pending.append((batch, self.pool.apply_async(_featurize, (batch,))))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()  # also on error: nothing is left running
            self.pool.join()
            self.pool = None


def build_split(
    examples: Iterable[QAExample],
    featurizers: Featurizers,
    directory: Path,
    vocab_size: int,
    evaluation: bool,
) -> SplitCounts:
    """Write one split's columns (and, for evaluation, its examples) into `directory`."""
    directory.mkdir(parents=True)
    columns = EVAL_COLUMNS if evaluation else TRAIN_COLUMNS
    writers: dict[str, ColumnWriter] = {}
    stored = ExampleWriter(directory) if evaluation else None
    counts = SplitCounts()
    id_type = ids_dtype(vocab_size)
    try:
        for batch, features in featurizers.map(examples):
            if len(features.input_ids) and int(features.input_ids.max()) >= vocab_size:
                raise ValueError(f"a token id is >= the tokenizer's vocab_size {vocab_size}")
            shifted = {"example_index": features.example_index + counts.examples}
            for name in columns:
                rows = shifted.get(name, getattr(features, name))
                if name not in writers:
                    dtype = id_type if name == "input_ids" else rows.dtype
                    writers[name] = ColumnWriter(directory / f"{name}.npy", dtype, rows.shape[1:])
                writers[name].append(rows)
            if stored is not None:
                stored.append(batch)
            counts.examples += len(batch)
            counts.windows += len(features)
            counts.tokens += int(features.lengths.sum())
    finally:
        for writer in writers.values():
            writer.close()
        if stored is not None:
            stored.close()
    return counts
